"""Client splits, per-client test sets and FedPG's S / G evaluation sets (docs/data.md).

A split is a pure function ``(labels, num_clients, rng, **params) -> list[index array]``
registered in ``SPLITS`` (``iid``, ``pat``, ``dir``, ``practical``); it returns one sorted
int64 index array per client and never hands a sample to two clients. ``make_partition``
applies a split to a dataset's official train/test labels and builds each client's test
set (``test_mode``: ``matched`` or ``pooled``) and, with ``val_frac`` > 0, a stratified
validation set carved out of each client's training share; its indices point into the
POOL, the concatenation ``[train split; test split]``. ``eval_sets`` draws the S and G sets
of FedPG's L / S / G accuracy (docs/metrics.md). Everything random comes from the seed.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from fedbench.errors import ConfigError, SplitError
from fedbench.registry import Registry

SplitFn = Callable[..., list[np.ndarray]]
SPLITS: Registry[SplitFn] = Registry("split")

log = logging.getLogger(__name__)

_MAX_TRIES = 1000  # dir per_class redraws before giving up on min_samples
# From this concentration on, `dir` uses the Dirichlet's mean instead of a draw: the limit
# alpha -> infinity, and exact, not an approximation: a draw's relative spread is about
# (alpha * share)^-1/2, at 1e100 some 1e-45 for any realistic share, far below float64's
# 1e-16, so numpy's draw would be the mean too, up to rounding. And numpy cannot draw near
# the float maximum (its gamma variates' sum overflows: zeros, NaN and warnings).
ALPHA_LIMIT = 1e100
# make_partition's keys, not the split's
_TEST_KEYS = ("test_mode", "test_per_client", "train_frac", "val_frac")
_ROWS = 20  # summary(): above this many clients show only the first and last rows


# ----------------------------------------------------------------------------- helpers


def _labels(labels: Any) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0)):
        raise SplitError(
            f"labels must be a 1-D array of non-negative integers, got shape {y.shape} "
            f"dtype {y.dtype}"
        )
    return y.astype(np.int64, copy=False)


def _check_clients(n: int, num_clients: int) -> None:
    if num_clients < 1:
        raise SplitError(f"num_clients={num_clients}; use at least 1")
    if num_clients > n:
        raise SplitError(
            f"num_clients={num_clients} but there are only {n} samples; use at most {n} clients"
        )


def _check_tpc(tpc: int | None, num_clients: int, n: int, low: int = 1) -> None:
    if tpc is None:
        return
    if tpc < low:
        raise SplitError(f"split.train_per_client={tpc}; use at least {low}")
    if tpc * num_clients > n:
        raise SplitError(
            f"split.train_per_client={tpc} for {num_clients} clients needs "
            f"{tpc * num_clients} samples but there are {n}; use at most {n // num_clients}"
        )


def _round_to(total: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Integer rows proportional to ``weights`` summing exactly to ``total`` (largest remainder)."""
    w = weights.astype(np.float64)
    sums = w.sum(axis=1, keepdims=True)
    raw = np.divide(w, sums, out=np.zeros_like(w), where=sums > 0) * total[:, None]
    base = np.floor(raw).astype(np.int64)
    left = total - base.sum(axis=1)
    order = np.argsort(base - raw, axis=1, kind="stable")  # largest fraction first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(w.shape[1])[None, :].repeat(len(w), 0), axis=1)
    return base + (rank < left[:, None])


def _round_capped(total: np.ndarray, weights: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Integer rows summing to ``total``, each entry the floor or ceil of its share of the
    row (proportional to ``weights``), with column sums within ``cap`` wherever possible.

    Which entries round up is a b-matching of rows to columns: greedy (largest fraction
    first), then augmenting paths for rows left short; a column overdraws only when no
    assignment avoids it.
    """
    w = weights.astype(np.float64)
    sums = w.sum(axis=1, keepdims=True)
    raw = np.divide(w, sums, out=np.zeros_like(w), where=sums > 0) * total[:, None]
    base = np.floor(raw).astype(np.int64)
    frac = raw - base
    elig = frac > 0
    up = np.zeros(w.shape, dtype=bool)
    left = total - base.sum(axis=1)
    room = cap - base.sum(axis=0)
    for r in np.flatnonzero(left > 0):
        cand = np.flatnonzero(elig[r] & (room > 0))
        cand = cand[np.argsort(-frac[r, cand], kind="stable")][: left[r]]
        up[r, cand] = True
        room[cand] -= 1
        left[r] -= len(cand)
    for r in np.flatnonzero(left > 0):
        while left[r] > 0 and _augment(r, elig, up, room):
            left[r] -= 1
        if left[r] > 0:  # a real shortage: round up anyway (those samples get reused)
            cand = np.flatnonzero(elig[r] & ~up[r])
            cand = cand[np.argsort(-frac[r, cand], kind="stable")][: left[r]]
            up[r, cand] = True
            room[cand] -= 1
    return base + up


def _augment(r: int, elig: np.ndarray, up: np.ndarray, room: np.ndarray) -> bool:
    """One more round-up for row r along a path r -> c1 -> r1 -> c2 ... -> column with room
    (r takes c1 from r1, r1 takes c2, ...). BFS; updates ``up`` and ``room`` in place."""
    parent: dict[int, tuple[int, int] | None] = {r: None}  # row -> (row taking its col, col)
    seen = np.zeros(up.shape[1], dtype=bool)
    queue = deque([r])
    while queue:
        x = queue.popleft()
        for c in np.flatnonzero(elig[x] & ~up[x] & ~seen).tolist():
            seen[c] = True
            if room[c] > 0:
                up[x, c] = True
                room[c] -= 1
                while (link := parent[x]) is not None:
                    px, pc = link
                    up[x, pc], up[px, pc] = False, True
                    x = px
                return True
            for y in np.flatnonzero(up[:, c]).tolist():
                if y not in parent:
                    parent[y] = (x, c)
                    queue.append(y)
    return False


def _class_counts(labels: np.ndarray, parts: list[np.ndarray], n_cls: int) -> np.ndarray:
    """(clients, classes) sample counts, in one bincount."""
    lens = np.array([len(p) for p in parts], dtype=np.int64)
    flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    ids = np.repeat(np.arange(len(parts)), lens)
    return np.bincount(ids * n_cls + labels[flat], minlength=len(parts) * n_cls).reshape(
        len(parts), n_cls
    )


def _take(
    labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator, cyclic: bool = False
) -> list[np.ndarray]:
    """Give client i ``counts[i, c]`` samples of class c.

    Each class is shuffled once and dealt in consecutive chunks, so no sample goes to two
    clients. ``cyclic`` wraps around a class that runs out (reuse): any chunk no longer than
    the class still holds no duplicates.
    """
    n_clients, n_cls = counts.shape
    sizes = np.bincount(labels, minlength=n_cls)
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]  # grouped by class, shuffled within
    starts = np.cumsum(sizes) - sizes
    offs = np.cumsum(counts, axis=0) - counts  # where client i's chunk of class c begins
    lens = counts.ravel()  # client-major, so the result comes out grouped by client
    pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    pos += np.repeat(offs.ravel(), lens)
    if cyclic:
        pos %= np.repeat(np.tile(sizes, n_clients), lens)
    flat = order[np.repeat(np.tile(starts, n_clients), lens) + pos]
    parts = np.split(flat, np.cumsum(counts.sum(axis=1))[:-1])
    return [np.sort(p) for p in parts]


def _fill(
    want: int, weights: np.ndarray, avail: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Draw ``want`` samples' classes by ``weights`` without replacement from ``avail``.

    A class that runs out passes its excess on to the classes that still have samples (by
    weight, or by what is left when all the weight sits on exhausted classes). The caller
    makes sure ``avail.sum() >= want``.
    """
    got = np.zeros_like(avail)
    while (left := want - int(got.sum())) > 0:
        room = avail - got
        w = np.where(room > 0, weights, 0.0)
        if not w.sum() > 0:
            w = room.astype(np.float64)
        got = np.minimum(got + rng.multinomial(left, w / w.sum()), avail)
    return got


def _uniq(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (np.unique's hash path is slow for these sizes)."""
    a = np.sort(x)
    return a[np.r_[True, a[1:] != a[:-1]]] if a.size else a


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (list, tuple)) or (hasattr(x, "__iter__") and not isinstance(x, str)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


# ------------------------------------------------------------------------------ splits


@SPLITS.register("iid")
def iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    train_per_client: int | None = None,
    **_: Any,
) -> list[np.ndarray]:
    """Uniform random equal shares (sizes differ by at most 1), or exactly train_per_client."""
    y = _labels(labels)
    _check_clients(len(y), num_clients)
    _check_tpc(train_per_client, num_clients, len(y))
    perm = rng.permutation(len(y))
    if train_per_client is None:
        parts = np.array_split(perm, num_clients)
    else:
        parts = np.split(perm[: num_clients * train_per_client], num_clients)
    return [np.sort(p) for p in parts]


@SPLITS.register("pat")
def pathological(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    balance: bool = True,
    train_per_client: int | None = None,
    **_: Any,
) -> list[np.ndarray]:
    """Pat-k: every client gets exactly k classes; each class goes to floor/ceil(N*k/C) clients.

    Without train_per_client each class is divided among its holders: ``balance`` gives a
    client the same count of each of its classes (the largest the data allows for all of
    them; a class's leftover from rounding is unused), otherwise a class is divided in
    random Dir(1) proportions (at least one sample each). With train_per_client every
    client gets exactly that many, split equally (balance) or in Dir(1) proportions over
    its classes.
    """
    y = _labels(labels)
    n, k = len(y), classes_per_client
    _check_clients(n, num_clients)
    sizes = np.bincount(y)
    present = np.flatnonzero(sizes)
    n_cls = len(present)
    if not 1 <= k <= n_cls:
        raise SplitError(
            f"split.classes_per_client={k} but the labels have {n_cls} classes; use 1 to {n_cls}"
        )
    _check_tpc(train_per_client, num_clients, n, low=k)
    # Deal each client the k least-held classes (random tie-break): holder counts stay
    # within 1 of each other, and class sets vary from client to client.
    own = np.zeros((num_clients, n_cls), dtype=bool)
    held = np.zeros(n_cls, dtype=np.int64)
    for i in range(num_clients):
        pick = np.argsort(held + rng.random(n_cls))[:k]
        own[i, pick] = True
        held[pick] += 1
    sz = sizes[present]
    if (bad := np.flatnonzero(held > sz)).size:
        c = bad[0]
        raise SplitError(
            f"pat: class {present[c]} has {sz[c]} samples but is dealt to {held[c]} clients; "
            f"use fewer clients or a smaller classes_per_client"
        )
    counts = np.zeros((num_clients, n_cls), dtype=np.int64)
    if train_per_client is None:
        if balance:
            share = np.where(own, sz // np.maximum(held, 1), np.iinfo(np.int64).max).min(axis=1)
            counts = own * share[:, None]
        else:
            for c in range(n_cls):
                h = np.flatnonzero(own[:, c])
                if h.size:
                    props = rng.dirichlet(np.ones(h.size))
                    counts[h, c] = 1 + rng.multinomial(sz[c] - h.size, props)
    else:
        if balance:
            # tpc // k of each class, the remainder to random classes of the client
            rank = np.argsort(np.argsort(np.where(own, rng.random(own.shape), 2.0), axis=1), axis=1)
            counts = own * (train_per_client // k) + (own & (rank < train_per_client % k))
        else:
            mix = rng.dirichlet(np.ones(k), size=num_clients)
            counts[own] = (1 + rng.multinomial(train_per_client - k, mix)).ravel()
        demand = counts.sum(axis=0)
        if (bad := np.flatnonzero(demand > sz)).size:
            c = bad[0]
            top = k * int((sz // np.maximum(held, 1))[held > 0].min())
            raise SplitError(
                f"pat: split.train_per_client={train_per_client} needs {demand[c]} samples of "
                f"class {present[c]} ({held[c]} clients) but it has {sz[c]}; use "
                f"train_per_client at most {top}" + ("" if balance else " or balance=true")
            )
    full = np.zeros((num_clients, len(sizes)), dtype=np.int64)
    full[:, present] = counts
    return _take(y, full, rng)


@SPLITS.register("dir")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.1,
    dir_mode: str = "per_class",
    dir_prior: str = "shares",
    min_samples: int = 10,
    train_per_client: int | None = None,
    **_: Any,
) -> list[np.ndarray]:
    """Dirichlet label skew.

    ``per_class`` (Hsu et al., PFLlib, FedSLR): each class is divided among the clients in
    Dir(alpha) proportions, redrawn until every client has at least min_samples; then
    train_per_client (if set) caps a client, keeping its class proportions.
    ``per_client`` (DiversiFed's code): client i draws its class mix q_i ~ Dir(alpha * p),
    p the class shares, then exactly train_per_client samples (default: N // clients) by
    q_i without replacement; a class that runs out passes its share to the others.
    ``dir_prior`` (per_client only) picks the concentration: ``shares``, alpha * p as the
    paper writes it (sums to alpha: at alpha = 0.1 on 10 classes nearly every client holds
    one class); ``ones``, alpha on every class (Dir(alpha * 1), what DiversiFed's reported
    Separate accuracies fit, see conf/experiment/diversifed_table2_fmnist.yaml).
    ``alpha`` >= ALPHA_LIMIT (1e100) is the limit alpha -> infinity: every class divided
    equally among the clients (per_class), every client's mix the prior's mean (per_client).
    """
    y = _labels(labels)
    n = len(y)
    _check_clients(n, num_clients)
    if not alpha > 0:
        raise ConfigError(f"split.alpha={alpha}; use a positive number")
    sizes = np.bincount(y)
    if dir_mode == "per_class":
        if train_per_client is not None and train_per_client < max(min_samples, 1):
            raise SplitError(
                f"split.train_per_client={train_per_client} is below min_samples={min_samples}; "
                f"use at least {max(min_samples, 1)}"
            )
        if num_clients * min_samples > n:
            raise SplitError(
                f"split.min_samples={min_samples} for {num_clients} clients needs "
                f"{num_clients * min_samples} samples but there are {n}; use at most "
                f"{n // num_clients}"
            )
        limit = alpha >= ALPHA_LIMIT
        for _try in range(_MAX_TRIES):
            if limit:  # every class divided equally: one deterministic "draw"
                props = np.full((len(sizes), num_clients), 1.0 / num_clients)
            else:
                props = rng.dirichlet(np.full(num_clients, alpha), size=len(sizes))  # (C, N)
            cuts = np.floor(np.cumsum(props, axis=1) * sizes[:, None]).astype(np.int64)
            cuts[:, -1] = sizes  # float cumsum may stop short of 1
            counts = np.diff(cuts, axis=1, prepend=0).T  # (N, C)
            if counts.sum(axis=1).min() >= min_samples:
                break
            if limit:
                raise SplitError(
                    f"dir per_class: even an equal division of every class (alpha={alpha:g} "
                    f">= {ALPHA_LIMIT:g} is the limit alpha -> infinity) leaves a client below "
                    f"min_samples={min_samples}; lower min_samples or use fewer clients"
                )
        else:
            raise SplitError(
                f"dir per_class: no Dir(alpha={alpha}) draw in {_MAX_TRIES} gave all "
                f"{num_clients} clients at least min_samples={min_samples} samples; raise "
                f"alpha, lower min_samples or use fewer clients"
            )
        if train_per_client is not None:
            over = counts.sum(axis=1) > train_per_client
            counts[over] = _round_to(np.full(over.sum(), train_per_client), counts[over])
    elif dir_mode == "per_client":
        tpc = n // num_clients if train_per_client is None else train_per_client
        _check_tpc(tpc, num_clients, n)
        present = np.flatnonzero(sizes)
        if dir_prior not in ("shares", "ones"):
            raise ConfigError(f"split.dir_prior={dir_prior!r}; valid: shares, ones")
        mix = np.zeros((num_clients, len(sizes)))
        if alpha >= ALPHA_LIMIT:  # the mean: p for Dir(alpha * p), uniform for Dir(alpha * 1)
            uniform = np.full(present.size, 1.0 / present.size)
            mix[:, present] = sizes[present] / n if dir_prior == "shares" else uniform
        else:
            if dir_prior == "shares":
                conc = alpha * sizes[present] / n
            else:
                conc = np.full(present.size, float(alpha))
            mix[:, present] = rng.dirichlet(conc, size=num_clients)
        avail = sizes.copy()
        counts = np.zeros((num_clients, len(sizes)), dtype=np.int64)
        for i in range(num_clients):
            counts[i] = _fill(tpc, np.nan_to_num(mix[i]), avail, rng)
            avail -= counts[i]
    else:
        raise ConfigError(f"split.dir_mode={dir_mode!r}; valid: per_class, per_client")
    return _take(y, counts, rng)


@SPLITS.register("practical")
def practical(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    groups: int = 3,
    dominant_classes: list[list[int]] | None = None,
    dominant_frac: float = 0.8,
    train_per_client: int | None = None,
    **_: Any,
) -> list[np.ndarray]:
    """DiversiFed's hospital split: ``groups`` groups of floor(N/groups) clients, the last
    taking the remainder; group g's dominant classes default to {3g, 3g+1, 3g+2}.

    Each client gets train_per_client samples, round(dominant_frac * that) from its group's
    dominant classes and the rest from the other classes, the class of each sample uniform
    within its part (RECONSTRUCTION, docs/data.md). Without train_per_client a client gets the
    largest count that every group's dominant classes can supply, at most N // clients.
    """
    y = _labels(labels)
    n = len(y)
    _check_clients(n, num_clients)
    sizes = np.bincount(y)
    n_cls = len(sizes)
    if not 0 <= dominant_frac <= 1:
        raise ConfigError(f"split.dominant_frac={dominant_frac}; use a number in [0, 1]")
    if groups < 1 or groups > num_clients:
        raise SplitError(f"split.groups={groups} for {num_clients} clients; use 1 to {num_clients}")
    if dominant_classes is None:
        if 3 * groups > n_cls:
            raise SplitError(
                f"split.groups={groups} needs {3 * groups} dominant classes but the labels have "
                f"{n_cls} classes; use at most {n_cls // 3} groups"
            )
        dominant_classes = [[3 * g, 3 * g + 1, 3 * g + 2] for g in range(groups)]
    dom = [np.asarray(d, dtype=np.int64) for d in dominant_classes]
    if len(dom) != groups or any(d.size == 0 or d.min() < 0 or d.max() >= n_cls for d in dom):
        raise SplitError(
            f"split.dominant_classes={_jsonable(dominant_classes)}: need {groups} non-empty "
            f"lists of classes in 0..{n_cls - 1}"
        )
    base = num_clients // groups
    group_of = np.minimum(np.arange(num_clients) // base, groups - 1)  # 20 -> 6, 6, 8
    g_size = np.bincount(group_of, minlength=groups)
    g_supply = np.array([sizes[d].sum() for d in dom])
    if train_per_client is None:
        tpc = n // num_clients
        if dominant_frac > 0:
            tpc = min(tpc, int((g_supply / (g_size * dominant_frac)).min()))
        while tpc > 0 and (g_size * round(dominant_frac * tpc) > g_supply).any():
            tpc -= 1  # float rounding of the bound above
        if tpc < 1:
            raise SplitError("practical: the dominant classes cannot supply a sample per client")
    else:
        tpc = train_per_client
    _check_tpc(tpc, num_clients, n)
    n_dom = round(dominant_frac * tpc)
    need = g_size * n_dom
    if (bad := np.flatnonzero(need > g_supply)).size:
        g = bad[0]
        top = int(g_supply[g] / (g_size[g] * dominant_frac))
        raise SplitError(
            f"practical: group {g} ({g_size[g]} clients) needs {need[g]} samples of its dominant "
            f"classes {dom[g].tolist()} but they have {g_supply[g]}; use train_per_client at "
            f"most {top}"
        )
    # Dominant parts first (they are the scarce ones), then the rest from what is left.
    avail = sizes.copy()
    counts = np.zeros((num_clients, n_cls), dtype=np.int64)
    for part in ("dominant", "other"):
        for i in range(num_clients):
            mask = np.zeros(n_cls, dtype=bool)
            mask[dom[group_of[i]]] = True
            want = n_dom if part == "dominant" else tpc - n_dom
            if part == "other":
                mask = ~mask
            room = np.where(mask, avail, 0)
            if room.sum() < want:
                raise SplitError(
                    f"practical: client {i} needs {want} samples outside its dominant classes "
                    f"but only {room.sum()} are left; use a smaller train_per_client"
                )
            got = _fill(want, (mask & (sizes > 0)).astype(np.float64), room, rng)
            counts[i] += got
            avail -= got
    return _take(y, counts, rng)


# --------------------------------------------------------------------------- partition


@dataclass(eq=False)
class Partition:
    """Every client's train and test indices into the POOL ``[train split; test split]``,
    and its validation indices (``val``: empty without ``split.val_frac``; disjoint from its
    train and test indices).

    ``meta``: split name, params, seed, test_mode, num_clients, n_train, n_test and
    ``warnings`` (a list of strings); JSON-serializable.
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    val: list[np.ndarray] = field(default_factory=list)

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        same = lambda a, b: len(a) == len(b) and all(map(np.array_equal, a, b))  # noqa: E731
        return (
            same(self.train, other.train)
            and same(self.test, other.test)
            and same(self.val, other.val)
            and (self.meta == other.meta)
        )

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> dict[str, Any]:
        out = {
            "train": [t.tolist() for t in self.train],
            "test": [t.tolist() for t in self.test],
            "meta": _jsonable(self.meta),
        }
        if self.val:  # absent without validation: partition.json as before the key
            out["val"] = [v.tolist() for v in self.val]
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Partition:
        arr = lambda xs: [np.asarray(x, dtype=np.int64) for x in xs]  # noqa: E731
        return cls(arr(d["train"]), arr(d["test"]), dict(d.get("meta", {})), arr(d.get("val", [])))

    def summary(self, labels_pool: np.ndarray, num_classes: int) -> str:
        """Text table: client, #train, #test, #classes, top classes (class:count in train)."""
        y = np.asarray(labels_pool, dtype=np.int64)
        cc = _class_counts(y, self.train, num_classes)
        n_tr, n_cls = cc.sum(axis=1), (cc > 0).sum(axis=1)
        n_te = np.array([len(t) for t in self.test], dtype=np.int64)
        n_va = np.array([len(v) for v in self.val], dtype=np.int64)
        m = self.meta
        val_head = f" {'#val':>5}" if self.val else ""
        out = [
            f"partition: split={m.get('split')} test_mode={m.get('test_mode')} "
            f"seed={m.get('seed')} clients={self.num_clients}",
            f"{'client':>6} {'#train':>7}{val_head} {'#test':>6} {'#classes':>8}  top classes",
        ]
        n = self.num_clients
        rows: list[int | None] = (
            list(range(n)) if n <= _ROWS else [*range(5), None, *range(n - 5, n)]
        )
        for i in rows:
            if i is None:
                out.append(f"{'...':>6}")
                continue
            top = np.argsort(-cc[i], kind="stable")[:3]
            tops = " ".join(f"{c}:{cc[i, c]}" for c in top if cc[i, c] > 0)
            val = f" {n_va[i]:>5}" if self.val else ""
            out.append(f"{i:>6} {n_tr[i]:>7}{val} {n_te[i]:>6} {n_cls[i]:>8}  {tops}")
        if n:
            cols = [("#train", n_tr), *([("#val", n_va)] if self.val else [])]
            cols += [("#test", n_te), ("#classes", n_cls)]
            stats = ", ".join(f"{name} {v.min()}/{np.median(v):g}/{v.max()}" for name, v in cols)
            out.append(f"min/median/max: {stats}")
        out += [f"warning: {w}" for w in m.get("warnings", [])]
        return "\n".join(out)


def _matched_tests(
    y_tr: np.ndarray,
    y_te: np.ndarray,
    train: list[np.ndarray],
    test_per_client: int | None,
    rng: np.random.Generator,
    warnings: list[str],
) -> list[np.ndarray]:
    """Test sets from the official test split with each client's train label proportions."""
    n_cls = int(max(y_tr.max(initial=0), y_te.max(initial=0))) + 1
    tr = _class_counts(y_tr, train, n_cls)
    n_i = tr.sum(axis=1)
    if test_per_client is None:  # fair share: the dataset's test:train ratio, at least 1
        want = np.maximum(1, len(y_te) * n_i // max(len(y_tr), 1))
    elif test_per_client < 1:
        raise SplitError(f"split.test_per_client={test_per_client}; use at least 1 (or null)")
    else:
        want = np.full(len(train), test_per_client, dtype=np.int64)
    weights = np.where(n_i[:, None] > 0, tr, tr.sum(axis=0))  # an empty client: overall mix
    supply = np.bincount(y_te, minlength=n_cls)
    counts = _round_capped(want, weights, supply)
    demand = counts.sum(axis=0)
    if (missing := np.flatnonzero((demand > 0) & (supply == 0))).size:
        raise SplitError(
            f"classes {missing.tolist()} are in clients' training data but not in the test "
            f"split; use split.test_mode=pooled"
        )
    if (short := np.flatnonzero(demand > supply)).size:
        msg = (
            f"matched test sets reuse {int((demand - supply)[short].sum())} test samples "
            f"({len(short)} classes run out: "
            + ", ".join(f"class {c} needs {demand[c]} has {supply[c]}" for c in short[:5])
            + (", ...)" if len(short) > 5 else ")")
        )
        warnings.append(msg)
        log.warning(msg)
    return _take(y_te, counts, rng, cyclic=True)


def carve_validation(
    labels_pool: np.ndarray, train: list[np.ndarray], val_frac: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val): each client's validation set carved out of its training indices,
    stratified: round(val_frac * n_i) samples (half up), divided among its classes in
    proportion to their counts (largest remainder), each class's drawn at random. The
    validation samples leave the training set. A client whose share leaves no validation
    or no training sample is a SplitError."""
    if not 0 <= val_frac < 1:
        raise ConfigError(f"split.val_frac={val_frac}; use a number in [0, 1)")
    y = _labels(labels_pool)
    n_cls = int(y.max(initial=0)) + 1
    sizes = np.array([len(t) for t in train], dtype=np.int64)
    want = np.floor(val_frac * sizes + 0.5).astype(np.int64)
    if (bad := np.flatnonzero((want < 1) | (want >= sizes))).size:
        i = int(bad[0])
        fix = (
            f"raise val_frac to at least {0.5 / max(sizes[i], 1):.3g} or give clients more "
            "training data"
            if want[i] < 1
            else "lower val_frac"
        )
        raise SplitError(
            f"split.val_frac={val_frac}: client {i} has {sizes[i]} training samples, too few "
            f"to carve a validation set ({want[i]} samples) and keep one to train on; {fix}"
        )
    per_class = _round_to(want, _class_counts(y, train, n_cls))
    new_train, val = [], []
    for i, t in enumerate(train):
        p = rng.permutation(t)
        p = p[np.argsort(y[p], kind="stable")]  # grouped by class, shuffled within
        yc = y[p]
        rank = np.arange(len(p)) - np.searchsorted(yc, yc)  # position within its class
        pick = rank < per_class[i, yc]
        val.append(np.sort(p[pick]))
        new_train.append(np.sort(p[~pick]))
    return new_train, val


def make_partition(
    y_train: np.ndarray,
    y_test: np.ndarray,
    num_clients: int,
    seed: int,
    split: str,
    params: Mapping[str, Any] | None,
) -> Partition:
    """Split the data for ``num_clients`` clients with split ``split`` and ``params``.

    ``params``: the ``split`` config (keys a split does not use are ignored; ``None`` values
    mean the default). ``test_mode``:

    - ``matched``: split the train split; each client's test set comes from the test split
      with the label proportions of its training data, ``test_per_client`` samples (default
      the fair share ``len(y_test) * n_i // len(y_train)``, at least 1), without replacement
      across clients while a class lasts, then reusing it (a warning in ``meta``).
    - ``pooled``: split train + test together, then each client's pool into train/test by
      ``train_frac`` (0.75); train_per_client then counts the whole pool.

    ``val_frac`` (default 0: none) carves each client's validation set out of its training
    share (`carve_validation`) with its own stream ``default_rng([seed, 2])``: the train and
    test sets drawn before it, and everything drawn from the partition's stream, are the
    same as without validation.
    """
    fn = SPLITS.get(split)
    params = _jsonable(dict(params or {}))
    y_tr, y_te = _labels(y_train), _labels(y_test)
    test_mode = params.get("test_mode") or "matched"
    kwargs = {k: v for k, v in params.items() if v is not None and k not in _TEST_KEYS}
    rng = np.random.default_rng(seed)
    warnings: list[str] = []
    if test_mode == "matched":
        train = fn(y_tr, num_clients, rng, **kwargs)
        test_per_client = params.get("test_per_client")
        tests = _matched_tests(y_tr, y_te, train, test_per_client, rng, warnings)
        test = [t + len(y_tr) for t in tests]
    elif test_mode == "pooled":
        frac = params.get("train_frac")
        frac = 0.75 if frac is None else frac
        if not 0 < frac < 1:
            raise ConfigError(f"split.train_frac={frac}; use a number strictly between 0 and 1")
        if params.get("test_per_client") is not None:
            warnings.append("split.test_per_client is ignored with test_mode=pooled")
        parts = fn(np.concatenate([y_tr, y_te]), num_clients, rng, **kwargs)
        train, test = [], []
        for i, p in enumerate(parts):
            if len(p) < 2:
                raise SplitError(
                    f"test_mode=pooled: client {i} has {len(p)} samples; each needs at least 2 "
                    f"(one train, one test)"
                )
            p = rng.permutation(p)
            k = min(max(round(frac * len(p)), 1), len(p) - 1)
            train.append(np.sort(p[:k]))
            test.append(np.sort(p[k:]))
    else:
        raise ConfigError(f"split.test_mode={test_mode!r}; valid: matched, pooled")
    val: list[np.ndarray] = []
    val_frac = params.get("val_frac") or 0.0
    if val_frac:
        train, val = carve_validation(
            np.concatenate([y_tr, y_te]), train, float(val_frac), np.random.default_rng([seed, 2])
        )
    meta = {
        "split": split,
        "params": params,
        "seed": _jsonable(seed),
        "test_mode": test_mode,
        "num_clients": num_clients,
        "n_train": len(y_tr),
        "n_test": len(y_te),
        "warnings": warnings,
    }
    return Partition(train, test, meta, val)


# ------------------------------------------------------------------------ L / S / G sets


class EvalSets(NamedTuple):
    """FedPG's S and G evaluation sets per client, as POOL indices (L is the own test set)."""

    s: list[np.ndarray]
    g: list[np.ndarray]


def eval_sets(partition: Partition, seed: int, s_frac: float = 0.5) -> EvalSets:
    """Draw S_i and G_i for every client once (docs/metrics.md, "L / S / G accuracy").

    G_i: a random sample, of the size of client i's test set, from the union of all test
    sets. S_i: client i's test set together with those of ceil(s_frac * (N - 1)) other
    random clients, uniformly subsampled to that size. Uses its own stream
    ``default_rng([seed, 1])`` so it does not disturb the partition's.
    """
    if not 0 <= s_frac <= 1:
        raise ConfigError(f"eval.s_frac={s_frac}; use a number in [0, 1]")
    rng = np.random.default_rng([seed, 1])
    tests = partition.test
    n = len(tests)
    union = _uniq(np.concatenate(tests)) if n else np.zeros(0, np.int64)
    n_others = math.ceil(s_frac * (n - 1))
    s_sets, g_sets = [], []
    for i, t in enumerate(tests):
        m = len(t)
        g_sets.append(np.sort(rng.choice(union, size=m, replace=m > len(union))))
        others = rng.choice(np.delete(np.arange(n), i), size=n_others, replace=False)
        pool = _uniq(np.concatenate([t, *(tests[j] for j in others)]))
        s_sets.append(np.sort(rng.choice(pool, size=m, replace=m > len(pool))))
    return EvalSets(s_sets, g_sets)
