"""FedSLR's baselines (docs/papers/fedslr.md): FedDyn and SCAFFOLD remove client drift on
heterogeneous quadratic clients where FedAvg with many local steps does not; LG-FedAvg
and FedSpa move only what they should; per-client state survives a checkpoint; every
algorithm of the FedSLR issue learns on real FMNIST."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import compose, make_algo, run_small
from fedbench.algorithms import ALGORITHMS
from fedbench.config import load_config
from fedbench.engine import Engine
from fedbench.errors import ConfigError


class QuadFed:
    """Three least-squares clients f_i(w) = 0.5 mean_b (x_b . w - y_b)^2 with different
    inputs and targets: their minimizers differ (heterogeneous), one full batch each."""

    def __init__(self, dim: int = 4, sizes=(8, 8, 8)) -> None:
        g = torch.Generator().manual_seed(3)
        xs, ys = [], []
        for k, n in enumerate(sizes):
            scale = torch.tensor([1.0, 0.3, 2.0, 0.7]).roll(k)[:dim]
            x = torch.randn(n, dim, generator=g) * scale
            w_k = torch.randn(dim, generator=g) * 2
            xs.append(x)
            ys.append(x @ w_k + 0.1 * torch.randn(n, generator=g))
        self.x, self.y = torch.cat(xs), torch.cat(ys)
        self.num_clients = len(sizes)
        starts = torch.tensor([0, *sizes]).cumsum(0)
        self.train_idx = [torch.arange(int(starts[i]), int(starts[i + 1])) for i in range(3)]
        self.test_idx = self.train_idx
        self.s_idx = self.g_idx = None
        self.train_sizes = torch.tensor([float(s) for s in sizes])

    def batch(self, idx, train=True):
        return self.x[idx], self.y[idx]

    def minimizer(self) -> torch.Tensor:
        """argmin (1/N) sum_i f_i: sum_i X_i^T X_i / n_i w = sum_i X_i^T y_i / n_i."""
        A = sum(self.x[i].T @ self.x[i] / len(i) for i in self.train_idx)
        b = sum(self.x[i].T @ self.y[i] / len(i) for i in self.train_idx)
        return torch.linalg.solve(A, b)


class QuadEngine(Engine):
    """The engine with the squared error as the clients' objective."""

    def train(self, *args, **kw):
        kw["objective"] = lambda model, x, y, c: 0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()
        return super().train(*args, **kw)


def quad_algo(name: str, extra=()):
    fed = QuadFed()
    cfg = compose(
        [
            f"algo={name}",
            "batch_size=100",  # full batch: deterministic local gradient descent
            "local_epochs=10",  # many local steps: FedAvg drifts
            "optim.lr=0.05",
            *extra,
        ]
    )
    torch.manual_seed(0)
    model_fn = lambda: nn.Linear(4, 1, bias=False)  # noqa: E731
    eng = QuadEngine(fed, model_fn(), device="cpu", backend="sequential")
    return ALGORITHMS.get(name).from_config(load_config(cfg), fed, eng, model_fn), fed


@pytest.mark.quick
@pytest.mark.parametrize(
    "name,extra",
    [("feddyn", ["algo.alpha=0.1"]), ("scaffold", []), ("fedavg", ["algo.weighting=uniform"])],
)
def test_client_drift_on_heterogeneous_quadratics(name, extra):
    algo, fed = quad_algo(name, extra)
    w_star = fed.minimizer()
    clients = np.arange(3)
    for t in range(200):
        algo.round(t, clients)
    err = float((algo.global_state()[:4] - w_star).norm() / w_star.norm())
    if name == "fedavg":
        assert err > 0.05, err  # the fixed point of many local steps is not the minimizer
    else:
        assert err < 1e-3, err


@pytest.mark.quick
def test_scaffold_partial_participation_control_variates():
    algo, fed = quad_algo("scaffold")
    sched = [[0, 1], [2], [1, 2], [0]]
    for t, c in enumerate(sched * 3):
        info = algo.round(t, np.array(c))
    # option II keeps c = mean of the clients' c_i when every update is counted
    assert torch.allclose(algo.c, algo.c_i.mean(0), atol=1e-5)
    # the last round (client 0): y and c_i up, x and c down; 4 parameters of 4 bytes
    assert info.comm.bytes_up == info.comm.bytes_down == 1 * 2 * 4 * 4


@pytest.mark.quick
@pytest.mark.parametrize("name", ["scaffold", "feddyn", "lg_fedavg", "fedspa"])
def test_checkpoint_keeps_per_client_state(name):
    algo, eng, fed = make_algo(name)
    algo.round(0, np.array([0, 2]))
    state = {k: v.clone() for k, v in algo.state_dict().items()}
    other, _, _ = make_algo(name, fed=fed)
    other.load_state_dict(state)
    algo.round(1, np.array([1, 2]))
    other.round(1, np.array([1, 2]))
    for k in algo.state_keys:
        assert torch.allclose(getattr(algo, k).float(), getattr(other, k).float(), atol=1e-6), k


@pytest.mark.quick
def test_lg_fedavg_shares_only_the_head():
    algo, eng, fed = make_algo("lg_fedavg")
    H = int(algo.head_entries.sum())
    info = algo.round(0, np.array([0, 1]))
    assert info.comm.bytes_up == info.comm.bytes_down == 2 * H * 4
    # client 2 was not sampled: its body is the initial one, with the new global head
    s2 = algo.personal_state(2)
    init = eng.initial_state()
    assert torch.equal(s2[~algo.head_entries], init[~algo.head_entries])
    assert torch.equal(s2[algo.head_entries], algo.head)
    # the sampled clients' bodies moved, and differ from each other
    b0, b1 = algo.bodies[0][~algo.head_entries], algo.bodies[1][~algo.head_entries]
    assert not torch.equal(b0, b1)


@pytest.mark.quick
def test_lg_fedavg_head_is_the_uniform_mean_by_default():
    """Both the FedSLR authors' train_LGFedAvg and pliang279/LG-FedAvg average the heads
    uniformly; TinyFed's clients have 37 and 20 samples, so n_k / n would differ."""
    algo, eng, fed = make_algo("lg_fedavg")
    assert algo.hp.weighting == "uniform"
    algo.round(0, np.array([0, 1]))
    heads = algo.bodies[[0, 1]][:, algo.head_entries]  # the trained states' heads
    assert torch.allclose(algo.head, heads.mean(0), atol=1e-7)


@pytest.mark.quick
def test_fedspa_masks_keep_their_density():
    algo, eng, fed = make_algo("fedspa", ["rounds=4"])
    before = algo.masks.clone()
    counts = [int(algo.masks[0, e.start : e.stop].sum()) for e in algo.layers]
    for t in range(3):
        algo.round(t, np.array([0, 1]))
    after = [int(algo.masks[0, e.start : e.stop].sum()) for e in algo.layers]
    assert after == counts  # prune-and-grow keeps each layer's count
    assert not torch.equal(before[0], algo.masks[0])  # the mask moved
    assert torch.equal(before[2], algo.masks[2])  # a client never sampled keeps its own
    P = eng.n_params
    s = algo.personal_state(0)
    assert (s[:P][~algo.masks[0]] == 0).all()
    assert algo.model_size()["params_personal"] == pytest.approx(
        float(algo.masks.sum(1).float().mean())
    )


@pytest.mark.quick
def test_fedspa_selections_break_ties_by_the_lowest_index():
    """Prune-and-grow selects among exact ties (weights of always-blank pixels have a gradient
    of exactly 0): the lowest indices win, on any device, where topk's order is the kernel's."""
    from fedbench.algorithms._shared import topk_lowest_index

    g = torch.tensor([0.0, 3.0, 0.0, 0.0, 2.0, 0.0, 3.0])
    assert topk_lowest_index(g, 3).tolist() == [1, 6, 4]
    assert topk_lowest_index(g, 4).tolist() == [1, 6, 4, 0]  # the first of the tied zeros
    assert topk_lowest_index(g, 3, largest=False).tolist() == [0, 2, 3]
    for k in range(1, 8):  # the same values as topk's selection
        assert sorted(g[topk_lowest_index(g, k)].tolist()) == sorted(g.topk(k).values.tolist())


@pytest.mark.quick
def test_fedspa_prune_grow_changes_only_the_next_mask():
    """The server averages the states as trained, each entry over exactly the clients whose
    TRAINED mask held it; prune-and-grow changes the mask for the next round only, so a
    grown entry is not zeroed in the global model and starts from it at the next download."""
    algo, eng, fed = make_algo("fedspa", ["rounds=4", "algo.prune_rate=0.5"])
    P = eng.n_params
    clients = np.array([0, 1])
    trained = []
    orig = algo.local_train

    def spy(*a, **kw):
        res = orig(*a, **kw)
        trained.append(res.states.clone())  # one call: every sampled client's row
        return res

    algo.local_train = spy
    w_old = algo.w.clone()
    m_old = algo.masks[torch.as_tensor(clients)].clone()  # [C, P]
    algo.round(0, clients)
    (up,) = trained  # [C, D] the trained states
    m_new = algo.masks[torch.as_tensor(clients)]
    assert not torch.equal(m_new, m_old)  # prune-and-grow moved the masks
    m = m_old.float()
    cnt = m.sum(0)
    expect = torch.where(cnt > 0, (up[:, :P] * m).sum(0) / cnt.clamp_min(1), w_old[:P])
    assert torch.allclose(algo.w[:P], expect, atol=1e-6)
    # client 0's grown entries: the global value there is the trained average, never 0
    grown = m_new[0] & ~m_old[0]
    assert grown.any()
    assert (algo.w[:P][grown] != 0).all()
    # ... and client 0's next download starts them from the global value
    assert torch.equal(algo.personal_state(0)[:P][grown], algo.w[:P][grown])
    # dropped entries of client 0 that it alone held keep its trained value
    dropped_only0 = m_old[0] & ~m_new[0] & ~m_old[1]
    assert dropped_only0.any()
    assert torch.equal(algo.w[:P][dropped_only0], up[0, :P][dropped_only0])


@pytest.mark.slow
def test_fedslr_paper_settings_come_with_the_preset():
    """`paper: fedslr` (the fedslr_* presets) brings FedSLR's appendix settings of single
    methods (conf/paper_algo/fedslr/); without the preset the algorithms' defaults apply."""
    from omegaconf import OmegaConf

    def algo(*over):
        return OmegaConf.to_container(compose(list(over)).algo, resolve=True)

    for preset in ("fedslr_t1_cifar10_dir", "fedslr_t1_tinyimagenet_iid", "fedslr_fmnist_dir"):
        p = f"+experiment={preset}"
        d = algo(p, "algo=ditto")
        assert (d["lam"], d["personal_epochs"]) == (0.1, 1)  # fusion 1 epoch, global E = 2
        d = algo(p, "algo=perfedavg")
        assert (d["alpha"], d["beta"]) == (0.01, 0.001)
        d = algo(p, "algo=apfl")
        assert (d["alpha"], d["adaptive"]) == (0.5, False)
        assert algo(p, "algo=feddyn")["alpha"] == 0.1
        assert algo(p, "algo=fedspa")["density"] == 0.5
        assert algo(p, "algo=lg_fedavg")["weighting"] == "uniform"
        d = algo(p, "algo=fedslr")
        assert (d["rank_penalty"], d["sparse_penalty"], d["fusion_epochs"]) == (1e-4, 1e-3, 1)
        assert compose([p]).local_epochs == 2
    # without a FedSLR preset, Ditto's personal phase is E epochs (its own default)
    assert algo("algo=ditto", "local_epochs=3")["personal_epochs"] == 3
    # another paper's preset does not pick FedSLR's settings
    assert algo("+experiment=fedpg_table1_cifar10", "algo=apfl")["adaptive"] is True


# ------------------------------------------------------------------ real FMNIST
# 20 clients pat-2 (2 classes each), MLP 784-64-10, 5 rounds at lr 0.05. Thresholds: the
# global model over 10 classes (chance 0.1) and the personal one on a client's own 2
# classes (chance 0.5).
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,kind,threshold",
    [
        ("feddyn", "global", 0.45),
        ("scaffold", "global", 0.45),
        ("lg_fedavg", "personal", 0.85),
        ("fedspa", "personal", 0.85),
    ],
)
def test_learns_fmnist(tmp_path, name, kind, threshold):
    summary, _ = run_small(tmp_path, [f"algo={name}", "optim.lr=0.05"], rounds=5)
    assert summary["final"][kind]["L"]["avg"] > threshold


@pytest.mark.quick
def test_scaffold_refuses_adam():
    """Option II's (x - y) / (K lr) is a mean gradient only for SGD steps."""
    with pytest.raises(ConfigError, match="optim.name=adam"):
        make_algo("scaffold", ["optim.name=adam"])


@pytest.mark.quick
@pytest.mark.parametrize("largest", [True, False])
def test_topk_lowest_index_is_a_stable_sorts_first_k(largest):
    """Against the full stable sort it replaces, on values with many exact ties (rounded
    to a few levels, zeros, infinities), for every k from 0 past n."""
    g = torch.Generator().manual_seed(0)
    v = torch.round(torch.randn(500, generator=g) * 2) / 2
    v[::7] = 0.0
    v[::11] = float("inf")
    v[::13] = -1.0
    from fedbench.algorithms._shared import first_k_mask, topk_lowest_index

    ref = torch.sort(v, descending=largest, stable=True).indices
    for k in (0, 1, 2, 17, 70, 250, 499, 500, 600):
        assert torch.equal(topk_lowest_index(v, k, largest=largest), ref[:k]), k
    rows = torch.stack([v, v.flip(0), torch.roll(v, 37)])  # batched: each row its own
    for k in (0, 1, 70, 499, 500):
        mask = first_k_mask(rows, k, largest)
        for r in range(3):
            want = torch.zeros(500, dtype=torch.bool)
            want[torch.sort(rows[r], descending=largest, stable=True).indices[:k]] = True
            assert torch.equal(mask[r], want), (k, r)
