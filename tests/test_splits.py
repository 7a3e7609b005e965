"""Property tests of fedbench.data.splits: the splits, make_partition and eval_sets."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from fedbench.data.splits import SPLITS, Partition, eval_sets, make_partition
from fedbench.errors import ConfigError, FedbenchError, SplitError

pytestmark = pytest.mark.quick

Y10 = np.repeat(np.arange(10), 600)  # 10 classes x 600
Y10_TEST = np.repeat(np.arange(10), 100)
Y100 = np.repeat(np.arange(100), 60)  # 100 classes x 60
Y100_TEST = np.repeat(np.arange(100), 20)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def check_parts(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    """One non-empty int64 array per client, in range, no index used twice."""
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 and p.ndim == 1 and p.size > 0 for p in parts)
    flat = np.concatenate(parts)
    assert flat.min() >= 0 and flat.max() < n
    assert len(np.unique(flat)) == len(flat)


def class_counts(labels: np.ndarray, parts: list[np.ndarray], n_cls: int) -> np.ndarray:
    return np.stack([np.bincount(labels[p], minlength=n_cls) for p in parts])


CONFIGS = [
    ("iid", {}, Y10, 20),
    ("iid", {"train_per_client": 50}, Y100, 100),
    ("pat", {"classes_per_client": 2}, Y10, 20),
    ("pat", {"classes_per_client": 3}, Y10, 7),
    ("pat", {"classes_per_client": 2, "balance": False}, Y10, 40),
    ("pat", {"classes_per_client": 10}, Y100, 30),
    ("pat", {"classes_per_client": 10, "balance": False, "train_per_client": 40}, Y100, 50),
    ("dir", {"alpha": 0.1}, Y10, 20),
    ("dir", {"alpha": 0.5}, Y100, 50),
    ("dir", {"alpha": 0.1, "dir_mode": "per_client", "train_per_client": 100}, Y10, 40),
    ("dir", {"alpha": 0.01, "dir_mode": "per_client"}, Y100, 30),
    ("practical", {"train_per_client": 100}, Y10, 20),
    ("practical", {}, Y10, 20),
    ("practical", {"groups": 2, "dominant_frac": 0.5}, Y100, 10),
]


@pytest.mark.parametrize("split,params,labels,n_clients", CONFIGS)
def test_split_properties(split, params, labels, n_clients):
    parts = SPLITS.get(split)(labels, n_clients, rng(), **params)
    check_parts(parts, len(labels), n_clients)
    again = SPLITS.get(split)(labels, n_clients, rng(), **params)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_registered_names():
    assert SPLITS.names() == ["dir", "iid", "pat", "practical"]


def test_iid_equal_sizes():
    parts = SPLITS.get("iid")(Y10, 7, rng())
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(Y10)


@pytest.mark.parametrize(
    "labels,n_clients,k",
    [(Y10, 20, 2), (Y10, 7, 3), (Y10, 13, 4), (Y100, 30, 10), (Y100, 100, 10), (Y10, 3, 10)],
)
@pytest.mark.parametrize("balance", [True, False])
def test_pat_classes(labels, n_clients, k, balance):
    n_cls = int(labels.max()) + 1
    parts = SPLITS.get("pat")(labels, n_clients, rng(1), classes_per_client=k, balance=balance)
    check_parts(parts, len(labels), n_clients)
    cc = class_counts(labels, parts, n_cls)
    assert ((cc > 0).sum(axis=1) == k).all()  # exactly k classes each
    holders = (cc > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1  # classes dealt evenly
    if balance:  # equal amounts of each of a client's classes
        assert all(len(set(row[row > 0])) == 1 for row in cc)
    assert len({tuple(np.flatnonzero(r)) for r in cc}) > 1 or n_clients == 1 or k == n_cls


def test_pat_unbalanced_is_unequal_and_uses_all_data():
    parts = SPLITS.get("pat")(Y10, 20, rng(), classes_per_client=2, balance=False)
    cc = class_counts(Y10, parts, 10)
    assert sum(len(p) for p in parts) == len(Y10)
    assert any(len(set(row[row > 0])) > 1 for row in cc)


@pytest.mark.parametrize("balance", [True, False])
def test_pat_train_per_client(balance):
    parts = SPLITS.get("pat")(
        Y10, 40, rng(), classes_per_client=2, balance=balance, train_per_client=31
    )
    cc = class_counts(Y10, parts, 10)
    assert all(len(p) == 31 for p in parts)
    assert ((cc > 0).sum(axis=1) == 2).all()
    if balance:
        assert set(np.sort(cc, axis=1)[:, -2:].ravel()) == {15, 16}


@pytest.mark.parametrize("labels,n_clients", [(Y10, 20), (Y10, 50), (Y100, 50)])
def test_dir_per_class_min_samples(labels, n_clients):
    parts = SPLITS.get("dir")(labels, n_clients, rng(), alpha=0.1, min_samples=15)
    check_parts(parts, len(labels), n_clients)
    assert min(len(p) for p in parts) >= 15
    assert sum(len(p) for p in parts) == len(labels)  # per_class uses all the data


def test_dir_per_class_cap():
    parts = SPLITS.get("dir")(Y10, 20, rng(), alpha=0.1, train_per_client=100)
    assert max(len(p) for p in parts) == 100 and min(len(p) for p in parts) >= 10


def test_dir_skew_grows_as_alpha_shrinks():
    def mean_classes(alpha: float) -> float:
        parts = SPLITS.get("dir")(Y10, 20, rng(), alpha=alpha, min_samples=1)
        return float((class_counts(Y10, parts, 10) >= 10).sum(axis=1).mean())

    assert mean_classes(0.05) < mean_classes(100.0)


def test_dir_per_client_exact_counts():
    parts = SPLITS.get("dir")(
        Y10, 40, rng(), alpha=0.1, dir_mode="per_client", train_per_client=120
    )
    check_parts(parts, len(Y10), 40)
    assert all(len(p) == 120 for p in parts)
    # all the data asked for: classes run out and pass their share on, still exact
    parts = SPLITS.get("dir")(Y10, 50, rng(), alpha=0.1, dir_mode="per_client")
    assert all(len(p) == 120 for p in parts)


def test_dir_per_client_prior():
    """Dir(alpha * p) sums to alpha (near one class per client at 0.1); Dir(alpha * 1) puts
    alpha on every class, so clients hold several classes."""

    def effective_classes(prior: str) -> float:
        parts = SPLITS.get("dir")(
            Y10, 40, rng(), alpha=0.1, dir_mode="per_client", dir_prior=prior,
            train_per_client=100,
        )  # fmt: skip
        share = class_counts(Y10, parts, 10) / 100
        return float((1 / (share**2).sum(axis=1)).mean())

    assert effective_classes("shares") < 1.5
    assert effective_classes("ones") > 1.8
    with pytest.raises(ConfigError, match="dir_prior"):
        SPLITS.get("dir")(Y10, 4, rng(), dir_mode="per_client", dir_prior="flat")


@pytest.mark.parametrize("alpha", [1e100, 1e200, 1e308])
@pytest.mark.parametrize(
    "mode, prior", [("per_class", "shares"), ("per_client", "shares"), ("per_client", "ones")]
)
def test_dir_alpha_above_the_limit_is_the_mean_without_a_warning(alpha, mode, prior):
    """alpha -> infinity: per_class divides every class equally (to one sample); per_client
    gives every client the prior's mean as its class mix (shares 1/2, 1/4, 1/4; ones: thirds),
    from which it draws its samples (a multinomial, as below the limit)."""
    import warnings

    y_skew = np.repeat(np.arange(3), [1200, 600, 600])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow / invalid-cast warnings fail it
        parts = SPLITS.get("dir")(
            y_skew, 20, rng(), alpha=alpha, dir_mode=mode, dir_prior=prior, train_per_client=60
        )
    check_parts(parts, len(y_skew), 20)
    cc = class_counts(y_skew, parts, 3)
    if mode == "per_class":  # 60, 30, 30 each, capped to 60 samples: 30, 15, 15
        assert cc.tolist() == [[30, 15, 15]] * 20
    else:  # 1200 samples by the mix: within 4 standard deviations (at most 20) of the mean
        want = [600, 300, 300] if prior == "shares" else [400, 400, 400]
        assert (cc.sum(axis=1) == 60).all() and (np.abs(cc.sum(axis=0) - want) <= 80).all(), cc
    # no draw: another seed divides the classes the same way (which samples still differ)
    again = SPLITS.get("dir")(
        y_skew, 20, rng(1), alpha=alpha, dir_mode=mode, dir_prior=prior, train_per_client=60
    )
    if mode == "per_class":
        assert (class_counts(y_skew, again, 3) == cc).all()


def test_dir_alpha_below_the_limit_draws_as_before():
    """Below ALPHA_LIMIT the split draws from numpy as it always did (a run's partition
    for a given seed does not move), and a huge alpha already gives near-equal shares."""
    from fedbench.data.splits import ALPHA_LIMIT

    a = SPLITS.get("dir")(Y10, 20, rng(), alpha=1e99, min_samples=1)
    g = rng()
    props = g.dirichlet(np.full(20, 1e99), size=10)  # the first draw is the split's
    cuts = np.floor(np.cumsum(props, axis=1) * 600).astype(np.int64)
    cuts[:, -1] = 600
    assert (class_counts(Y10, a, 10) == np.diff(cuts, axis=1, prepend=0).T).all()
    assert (class_counts(Y10, a, 10) >= 29).all() and ALPHA_LIMIT == 1e100


def test_dir_per_class_limit_below_min_samples_names_the_limit():
    with pytest.raises(SplitError, match="even an equal division") as e:
        # 2 samples of each class for 3 clients: 0, 1, 1 each, so client 0 holds none
        SPLITS.get("dir")(np.repeat(np.arange(3), 2), 3, rng(), alpha=1e300, min_samples=2)
    assert "raise alpha" not in str(e.value) and "\n" not in str(e.value)


def test_practical_groups():
    tpc = 100
    parts = SPLITS.get("practical")(Y10, 20, rng(), train_per_client=tpc)
    check_parts(parts, len(Y10), 20)
    cc = class_counts(Y10, parts, 10)
    groups = [range(0, 6), range(6, 12), range(12, 20)]  # 20 clients -> 6, 6, 8
    for g, members in enumerate(groups):
        dom = [3 * g, 3 * g + 1, 3 * g + 2]
        for i in members:
            assert cc[i].sum() == tpc
            assert cc[i, dom].sum() == 80  # dominant_frac 0.8
            assert (cc[i, dom] > 0).all()
    # each client's most frequent classes are its group's
    assert all(set(np.argsort(-cc[i])[:3]) == {0, 1, 2} for i in groups[0])


def test_practical_custom_dominant_classes():
    parts = SPLITS.get("practical")(
        Y10,
        4,
        rng(),
        groups=2,
        dominant_classes=[[9], [0, 5]],
        dominant_frac=1.0,
        train_per_client=50,
    )
    cc = class_counts(Y10, parts, 10)
    assert (cc[:2, 9] == 50).all() and (cc[2:, [0, 5]].sum(axis=1) == 50).all()


@pytest.mark.parametrize(
    "split,params",
    [
        ("iid", {}),
        ("pat", {}),
        ("pat", {"balance": False}),
        ("dir", {}),
        ("dir", {"dir_mode": "per_client", "train_per_client": 100}),
        ("practical", {"train_per_client": 100}),
    ],
)
def test_matched_test_sets(split, params):
    n_tr = len(Y10)
    p = make_partition(Y10, Y10_TEST, 20, 3, split, {**params, "test_per_client": 30})
    check_parts(p.train, n_tr, 20)
    pool = np.concatenate([Y10, Y10_TEST])
    for tr, te in zip(p.train, p.test):
        assert len(te) == 30 and te.min() >= n_tr and te.max() < len(pool)
        assert len(np.unique(te)) == len(te)
        c_tr = np.bincount(pool[tr], minlength=10)
        c_te = np.bincount(pool[te], minlength=10)
        assert np.all(np.abs(c_te - 30 * c_tr / c_tr.sum()) < 1)  # same mix, within rounding
    if not p.meta["warnings"]:  # the test split sufficed: no test sample shared
        flat = np.concatenate(p.test)
        assert len(np.unique(flat)) == len(flat)


@pytest.mark.parametrize(
    "split,labels,labels_test,n_clients",
    [
        ("pat", Y10, Y10_TEST, 20),
        ("iid", Y10, Y10_TEST, 100),
        ("iid", Y100, Y100_TEST, 40),
        ("dir", Y100, Y100_TEST, 40),
    ],
)
def test_matched_fair_share_disjoint(split, labels, labels_test, n_clients):
    # the fair share uses the whole test split: rounding must still not force any reuse
    p = make_partition(labels, labels_test, n_clients, 0, split, {})
    sizes = [len(t) for t in p.test]
    assert sizes == [len(labels_test) * len(tr) // len(labels) for tr in p.train]
    flat = np.concatenate(p.test)
    assert len(np.unique(flat)) == len(flat) and p.meta["warnings"] == []


def test_matched_reuse_warns():
    p = make_partition(Y10, Y10_TEST, 10, 0, "iid", {"test_per_client": 200})
    assert len(p.meta["warnings"]) == 1 and "reuse 1000 test samples" in p.meta["warnings"][0]
    assert all(len(np.unique(t)) == 200 for t in p.test)  # no duplicate within a client


def test_matched_missing_test_class():
    with pytest.raises(SplitError, match="test_mode=pooled"):
        make_partition(Y10, Y10_TEST[Y10_TEST != 3], 5, 0, "iid", {})


@pytest.mark.parametrize("split", ["iid", "pat", "dir"])
def test_pooled(split):
    n = len(Y10) + len(Y10_TEST)
    p = make_partition(Y10, Y10_TEST, 20, 0, split, {"test_mode": "pooled", "train_frac": 0.8})
    assert p.meta["test_mode"] == "pooled"
    check_parts([np.concatenate([a, b]) for a, b in zip(p.train, p.test)], n, 20)
    for tr, te in zip(p.train, p.test):
        assert len(tr) > 0 and len(te) > 0
        assert abs(len(tr) - 0.8 * (len(tr) + len(te))) <= 1
    assert max(t.max() for t in p.test) >= len(Y10)  # test samples of the test split used


def test_determinism_and_seed():
    params = {"alpha": 0.3, "test_per_client": 20}
    a = make_partition(Y10, Y10_TEST, 20, 7, "dir", params)
    b = make_partition(Y10, Y10_TEST, 20, 7, "dir", params)
    c = make_partition(Y10, Y10_TEST, 20, 8, "dir", params)
    assert a == b and a != c


def test_json_roundtrip():
    p = make_partition(Y10, Y10_TEST, 10, 1, "pat", {"balance": False, "train_per_client": None})
    q = Partition.from_json(json.loads(json.dumps(p.to_json())))
    assert q == p and all(t.dtype == np.int64 for t in q.train + q.test)
    assert q.meta["split"] == "pat" and q.meta["seed"] == 1 and q.meta["warnings"] == []


def test_summary():
    pool = np.concatenate([Y10, Y10_TEST])
    small = make_partition(Y10, Y10_TEST, 4, 0, "pat", {}).summary(pool, 10)
    assert "#train" in small and "..." not in small and len(small.splitlines()) == 2 + 4 + 1
    big = make_partition(Y10, Y10_TEST, 60, 0, "pat", {}).summary(pool, 10)
    assert "..." in big and "min/median/max" in big and len(big.splitlines()) < 20


IMPOSSIBLE = [
    ("pat", {"classes_per_client": 11}, 10, "at most|1 to 10"),
    ("pat", {"classes_per_client": 0}, 10, "1 to 10"),
    ("pat", {"train_per_client": 500}, 20, "train_per_client"),
    ("iid", {}, 7000, "num_clients=7000"),
    ("iid", {"train_per_client": 601}, 10, "at most 600"),
    ("dir", {"dir_mode": "per_client", "train_per_client": 200}, 40, "at most 150"),
    ("dir", {"min_samples": 400}, 20, "min_samples"),
    ("dir", {"alpha": 0.001, "min_samples": 290}, 20, "raise alpha"),
    ("dir", {"train_per_client": 5}, 20, "below min_samples"),
    ("practical", {"groups": 4}, 20, "at most 3 groups"),
    ("practical", {"train_per_client": 300}, 20, "dominant"),
    ("practical", {"groups": 21}, 20, "groups=21"),
]


@pytest.mark.parametrize("split,params,n_clients,match", IMPOSSIBLE)
def test_impossible(split, params, n_clients, match):
    with pytest.raises(SplitError, match=match) as e:
        SPLITS.get(split)(Y10, n_clients, rng(), **params)
    assert "\n" not in str(e.value)


def test_pooled_needs_two_samples_per_client():
    with pytest.raises(SplitError, match="at least 2"):
        make_partition(Y10[:15], Y10_TEST[:5], 20, 0, "iid", {"test_mode": "pooled"})


@pytest.mark.parametrize(
    "split,params",
    [
        ("nope", {}),
        ("dir", {"dir_mode": "bogus"}),
        ("dir", {"alpha": 0}),
        ("iid", {"test_mode": "bogus"}),
        ("iid", {"test_mode": "pooled", "train_frac": 1.0}),
    ],
)
def test_bad_config(split, params):
    with pytest.raises(ConfigError) as e:
        make_partition(Y10, Y10_TEST, 5, 0, split, params)
    assert isinstance(e.value, FedbenchError) and "\n" not in str(e.value)


@pytest.mark.parametrize("test_mode", ["pooled", "matched"])
def test_eval_sets(test_mode):
    n_clients, s_frac = 10, 0.3
    p = make_partition(
        Y10, Y10_TEST, n_clients, 0, "pat", {"test_mode": test_mode, "test_per_client": 30}
    )
    s, g = eval_sets(p, seed=0, s_frac=s_frac)
    union = set(np.concatenate(p.test).tolist())
    owners: dict[int, set[int]] = {}
    for i, t in enumerate(p.test):
        for k in t.tolist():
            owners.setdefault(k, set()).add(i)
    n_others = math.ceil(s_frac * (n_clients - 1))
    for i, t in enumerate(p.test):
        assert len(s[i]) == len(g[i]) == len(t)
        assert set(g[i].tolist()) <= union and len(np.unique(g[i])) == len(t)
        assert len(np.unique(s[i])) == len(t)
        # S_i lies in the own test set plus those of at most n_others other clients
        touched = set().union(*(owners[k] for k in s[i].tolist()))
        if test_mode == "pooled":  # disjoint test sets: the owners are known
            assert len(touched - {i}) <= n_others
    s2, g2 = eval_sets(p, seed=0, s_frac=s_frac)
    assert all(np.array_equal(a, b) for a, b in zip(s + g, s2 + g2))


def test_eval_sets_s_frac_zero_and_one_client():
    p = make_partition(Y10, Y10_TEST, 8, 0, "pat", {"test_mode": "pooled"})
    s, _ = eval_sets(p, 0, s_frac=0.0)
    assert all(np.array_equal(a, t) for a, t in zip(s, p.test))
    one = make_partition(Y10, Y10_TEST, 1, 0, "iid", {"test_per_client": 50})
    s, g = eval_sets(one, 0)
    assert np.array_equal(s[0], one.test[0]) and np.array_equal(g[0], one.test[0])


def test_fast_at_fmnist_scale():
    y_tr, y_te = np.repeat(np.arange(10), 6000), np.repeat(np.arange(10), 1000)
    y100 = np.repeat(np.arange(100), 500)
    start = time.perf_counter()
    for split, params in [
        ("pat", {}),
        ("dir", {}),
        ("dir", {"dir_mode": "per_client", "train_per_client": 300}),
        ("practical", {}),
    ]:
        p = make_partition(y_tr, y_te, 100, 0, split, params)
    eval_sets(p, 0)
    make_partition(y100, np.repeat(np.arange(100), 100), 100, 0, "pat", {"classes_per_client": 10})
    assert time.perf_counter() - start < 2.0
