"""FedSLR (docs/papers/fedslr.md): the prox operators against hand-computed values, the
memory-efficient server against the per-client form, the zero-penalty reduction, and a
real FMNIST run whose mixed model learns while its GKR becomes low rank."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from conftest import compose, make_algo, run_small
from fedbench.algorithms.fedslr import FedSLR
from fedbench.config import load_config
from fedbench.engine.prox import (
    factorized_params,
    from_matrix,
    matrix_entries,
    matrix_ranks,
    nuclear_prox,
    soft_threshold,
    svt,
    svt_gram,
    to_matrix,
)
from fedbench.engine.spec import ModelSpec
from fedbench.engine.terms import Proximal


def rot(a: float) -> torch.Tensor:
    return torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])


def assert_clear_of_threshold(w: torch.Tensor, spec: ModelSpec, tau: float, margin: float):
    """Every matrix layer's singular values (float64) lie more than `margin` from `tau`: a
    rank after the prox at tau is then the same whichever SVD computed it (a singular value
    ON the threshold lands on either side by the solver's last-bit error, CPU-dependently)."""
    for e in matrix_entries(spec):
        s = torch.linalg.svdvals(to_matrix(w[e.start : e.stop].view(e.shape)).double())
        gap = float((s - tau).abs().min())
        assert gap > margin, f"{e.name}: a singular value {gap:.2g} from tau = {tau}"


# ------------------------------------------------------------------ prox operators
@pytest.mark.quick
def test_svt_hand_computed():
    # W = U diag(3, 0.5) V^T with rotations U (30 deg), V (45 deg); tau = 1:
    # singular values 3 -> 2, 0.5 -> 0, so the result is 2 u1 v1^T and the rank drops to 1.
    U, V = rot(math.pi / 6), rot(math.pi / 4)
    W = U @ torch.diag(torch.tensor([3.0, 0.5])) @ V.T
    out, rank = svt(W, 1.0)
    expect = 2.0 * torch.outer(U[:, 0], V[:, 0])
    assert torch.allclose(out, expect, atol=1e-6)
    assert int(rank) == 1
    assert torch.allclose(torch.linalg.svdvals(out), torch.tensor([2.0, 0.0]), atol=1e-6)
    # tau below every singular value: each shrinks by tau, rank stays
    out, rank = svt(W, 0.25)
    assert torch.allclose(torch.linalg.svdvals(out), torch.tensor([2.75, 0.25]), atol=1e-6)
    assert int(rank) == 2
    # a diagonal case by hand
    out, rank = svt(torch.diag(torch.tensor([3.0, 1.0, 0.5])), 0.75)
    assert torch.allclose(out, torch.diag(torch.tensor([2.25, 0.25, 0.0])), atol=1e-6)
    assert int(rank) == 2


@pytest.mark.quick
def test_conv_reshape_round_trip_and_layout():
    w = torch.randn(5, 3, 2, 4)
    m = to_matrix(w)
    assert m.shape == (5 * 2, 3 * 4)
    # (out, in, kh, kw) -> (out, kh, in, kw) -> (out*kh, in*kw)
    for o, i, a, b in [(0, 0, 0, 0), (4, 2, 1, 3), (2, 1, 0, 2)]:
        assert m[o * 2 + a, i * 4 + b] == w[o, i, a, b]
    assert torch.equal(from_matrix(m, w.shape), w)
    lin = torch.randn(4, 7)
    assert torch.equal(to_matrix(lin), lin)
    assert torch.equal(from_matrix(to_matrix(lin), lin.shape), lin)


@pytest.mark.quick
def test_soft_threshold():
    x = torch.tensor([-2.0, -0.3, 0.0, 0.2, 0.5, 3.0])
    assert torch.allclose(soft_threshold(x, 0.5), torch.tensor([-1.5, 0.0, 0.0, 0.0, 0.0, 2.5]))
    assert torch.equal(soft_threshold(x, 0.0), x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)  # same matrix shape (12, 12) as conv: one batched SVD
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(8, 5)


@pytest.mark.quick
def test_nuclear_prox_per_layer():
    torch.manual_seed(0)
    model = ConvNet()
    spec = ModelSpec(model)
    w = spec.flatten(model)
    # the ranks below compare the batched float32 SVD with svdvals of each matrix: the
    # nearest singular value is 3.7e-4 from tau = 0.3, ~1e4 times their float32 error
    assert_clear_of_threshold(w, spec, 0.3, margin=1e-5)
    out, ranks = nuclear_prox(w, spec, 0.3)
    assert [r.name for r in ranks] == ["conv.weight", "conv2.weight", "fc.weight"]
    for e in spec.params:
        a, b = w[e.start : e.stop].view(e.shape), out[e.start : e.stop].view(e.shape)
        if len(e.shape) < 2:  # biases and norm parameters: untouched
            assert torch.equal(a, b)
            continue
        s = torch.linalg.svdvals(to_matrix(a))
        s2 = torch.linalg.svdvals(to_matrix(b))
        expect = (s - 0.3).clamp_min(0)
        assert torch.allclose(s2, expect, atol=1e-5), e.name
        r = next(r for r in ranks if r.name == e.name)
        assert r.rank == int((expect > 0).sum())
    # a large tau zeroes every matrix: the factorized size is the 1-D tensors alone
    out, ranks = nuclear_prox(w, spec, 100.0)
    assert all(r.rank == 0 for r in ranks)
    n_1d = sum(e.stop - e.start for e in spec.params if len(e.shape) < 2)
    assert factorized_params(spec, ranks) == n_1d
    # full rank: a matrix costs min(r (m + n), m n) = m n
    full = matrix_ranks(w, spec)
    assert factorized_params(spec, full) == spec.n_params
    # rank 1 of fc (5 x 8): 13 numbers instead of 40
    r1 = [r if r.name != "fc.weight" else type(r)(r.name, 5, 8, 1) for r in full]
    assert factorized_params(spec, r1) == spec.n_params - 40 + 13


# ------------------------------------------------------------------ the server
class PerClientFedSLR(FedSLR):
    """The per-client server form: z = mean x_i - (1 / (alpha N)) sum over all N clients of
    their stored lambda_i (no running h)."""

    def server_average(self, x):
        P = self.engine.n_params
        z = x.mean(0)
        z[:P] -= self.lam.sum(0) / (self.alpha * self.N)
        return z


@pytest.mark.quick
def test_memory_efficient_server_equals_per_client_form():
    extra = ["algo.rank_penalty=0.03", "algo.sparse_penalty=0.01"]
    algo, eng, fed = make_algo("fedslr", extra)
    cfg = compose(["algo=fedslr", "batch_size=8", "optim.lr=0.1", *extra])  # as make_algo
    ref = PerClientFedSLR.from_config(load_config(cfg), fed, eng, algo.model_fn)
    zs = []
    for form in (algo, ref):
        form.server_average = lambda x, real=form.server_average: zs.append(real(x)) or zs[-1]
    schedule = [[0, 2], [1], [1, 2], [0], [0, 1, 2], [2]]
    for t, clients in enumerate(schedule):
        a = algo.round(t, np.array(clients))
        b = ref.round(t, np.array(clients))
        # the two forms' z differ by ~1e-7 (float32 sums in another order); the ranks (and
        # gkr_params) are compared exactly, so no singular value of z may sit near tau
        # (measured: 0.028 away at least)
        for z in zs[-2:]:
            assert_clear_of_threshold(z, eng.spec, algo.tau, margin=1e-4)
        assert torch.allclose(algo.theta, ref.theta, atol=1e-5), t
        assert torch.allclose(algo.p, ref.p, atol=1e-5), t
        assert a.diagnostics["gkr_params"] == b.diagnostics["gkr_params"]
    # h is the mean of the stored lambda_i
    assert torch.allclose(algo.h, algo.lam.mean(0), atol=1e-6)
    # the prox acted (the penalty is scaled to this toy model): the GKR lost rank
    assert any(r.rank < r.full for r in algo.ranks)


@pytest.mark.quick
def test_zero_penalties_reduce_to_feddyn_and_plain_fusion_sgd():
    extra = [
        "algo.rank_penalty=0",
        "algo.sparse_penalty=0",
        "optim.weight_decay=0.01",
        "algo.fusion_weight_decay=0.01",
    ]
    slr, eng, fed = make_algo("fedslr", extra)
    dyn, _, _ = make_algo("feddyn", ["optim.weight_decay=0.01"], fed=fed)
    for t, clients in enumerate([[0, 2], [1], [0, 1, 2]]):
        sent = slr.theta.clone()
        p_before = slr.p.clone()
        slr.round(t, np.array(clients))
        dyn.round(t, np.array(clients))
        # Phase I without the prox is FedDyn
        assert torch.allclose(slr.theta, dyn.theta, atol=1e-6), t
        # Phase II without soft-thresholding: SGD on f_i(theta^t + p) + (wd / 2) ||p||^2, the
        # engine's own loop on the state theta^t + p with a proximal term at theta^t
        P = eng.n_params
        for i in clients:
            start = sent.clone()
            start[:P] += p_before[i]
            res = slr.local_train(
                start,
                [i],
                t,
                epochs=1,
                terms=[Proximal(sent, 0.01)],
                optim=slr.optim.replace(weight_decay=0.0),
                salt=1,
            )
            assert torch.allclose(slr.p[i], res.states[0, :P] - sent[:P], atol=1e-5), (t, i)


@pytest.mark.quick
def test_p_init_and_sparsity():
    algo, eng, _ = make_algo("fedslr", ["algo.sparse_penalty=0.5"])
    P = eng.n_params
    # copy: Conv/Linear weights and biases start as the initial weights (the MLP: all of them)
    assert torch.equal(algo.p[1], algo.theta[:P])
    algo.round(0, np.array([0, 1]))
    # soft-thresholding at eta * lambda_s = 0.05 makes p sparse; client 2 not trained yet
    assert (algo.p[0] == 0).float().mean() > 0.3
    assert torch.equal(algo.p[2], eng.initial_state()[:P])
    zero, _, _ = make_algo("fedslr", ["algo.p_init=zero"])
    assert not zero.p.any()
    # the mixed model is GKR + p_i, one row at a time
    s = algo.personal_state(0)
    assert torch.allclose(s[:P], algo.theta[:P] + algo.p[0])
    assert torch.allclose(algo.personal_states()[0], s)


@pytest.mark.quick
def test_phase2_one_batch_by_hand():
    """One Phase II batch by hand: p' = soft_threshold(p - lr (g + wd_f p), lr lambda_s), g
    the autograd gradient of the cross-entropy at theta^t + p, wd_f = fusion_weight_decay
    (1e-3 by default, NOT the run's optim.weight_decay). Batch 64: client 0's 37 samples
    are its one batch (Phase II's own stream, salt 1)."""
    algo, eng, fed = make_algo(
        "fedslr", ["algo.sparse_penalty=0.3", "optim.weight_decay=0.05", "batch_size=64"], lr=0.1
    )
    assert algo.hp.fusion_weight_decay == 1e-3
    P = eng.n_params
    idx, lens = eng.schedule(0, 64, epochs=1, round=0, salt=1)
    assert idx.shape[0] == 1  # one batch
    x, y = fed.batch(idx[0, : lens[0]])
    base = algo.theta.clone()
    p = algo.p[0].clone()
    model = algo.model_fn().to(algo.device)
    state = base.clone()
    state[:P] += p
    eng.spec.load_into(model, state)
    params = [q for _, q in model.named_parameters()]
    loss = nn.functional.cross_entropy(model(x), y)
    g = torch.cat([q.reshape(-1) for q in torch.autograd.grad(loss, params)])
    lr, wd, lam = 0.1, 1e-3, 0.3
    v = p - lr * (g + wd * p)
    expect = torch.sign(v) * (v.abs() - lr * lam).clamp_min(0)
    assert (expect == 0).any() and (expect != 0).any()  # the threshold acts, not on all
    # the zero pattern is compared exactly below: no |v| within 1e-5 of the threshold
    # (measured 4.5e-3), far above float32 rounding of v (~3e-8)
    assert ((v.abs() - lr * lam).abs() > 1e-5).all()
    algo.fusion([0], base, 0)
    assert torch.allclose(algo.p[0], expect, atol=1e-7, rtol=0)
    assert torch.equal(algo.p[0] == 0, expect == 0)
    assert int(algo.p_nnz[0]) == int((expect != 0).sum())


class ConvGN(nn.Module):
    """Conv -> GroupNorm -> Linear, all with biases, on 3x6x6 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x.view(-1, 3, 6, 6)))).flatten(1))


@pytest.mark.quick
def test_p_init_copy_on_conv_groupnorm():
    """copy: every Conv/Linear tensor's p (biases too) is the initial weights; the norm
    layers' p is 0."""
    from conftest import TinyFed, compose
    from fedbench.engine import Engine

    fed = TinyFed(dim=3 * 6 * 6)
    cfg = compose(["algo=fedslr", "batch_size=8"])
    torch.manual_seed(0)
    eng = Engine(fed, ConvGN(), device="cpu")
    algo = FedSLR.from_config(load_config(cfg), fed, eng, ConvGN)
    init = eng.initial_state()
    seen = set()
    for e in eng.spec.params:
        sl = slice(e.start, e.stop)
        for i in range(fed.num_clients):
            if e.name.startswith("norm."):
                assert not algo.p[i, sl].any(), e.name
            else:
                assert torch.equal(algo.p[i, sl], init[sl]), e.name
        seen.add(e.name)
    assert seen == {"conv.weight", "conv.bias", "norm.weight", "norm.bias", "fc.weight", "fc.bias"}
    assert algo.p_nnz.tolist() == [int((algo.p[0] != 0).sum())] * fed.num_clients


@pytest.mark.quick
def test_server_prox_threshold_is_rank_penalty_over_alpha():
    """theta^{t+1}'s singular values are z's minus rank_penalty / alpha, clamped at 0, per
    matrix layer (alpha = 0.1, rank_penalty = 0.03: tau = 0.3, not 0.03 or 0.003)."""
    algo, eng, fed = make_algo("fedslr", ["algo.alpha=0.1", "algo.rank_penalty=0.03"])
    zs = []
    orig = algo.server_average

    def spy(x):
        z = orig(x)
        zs.append(z.clone())
        return z

    algo.server_average = spy
    algo.round(0, np.array([0, 1, 2]))
    z, theta = zs[0], algo.theta
    dropped = False
    for e in eng.spec.params:
        a, b = z[e.start : e.stop].view(e.shape), theta[e.start : e.stop].view(e.shape)
        if len(e.shape) < 2:
            assert torch.equal(a, b)
            continue
        s, s2 = torch.linalg.svdvals(to_matrix(a)), torch.linalg.svdvals(to_matrix(b))
        assert torch.allclose(s2, (s - 0.03 / 0.1).clamp_min(0), atol=1e-5), e.name
        dropped |= bool((s < 0.3).any())
    assert dropped  # some singular value went to 0


@pytest.mark.quick
def test_bytes_down_is_the_factorized_gkr_at_the_rounds_start():
    """bytes_down = 4 C (sum over matrices of min(r (m + n), m n) at the ranks theta^t had
    when sent + the 1-D tensors + the buffers), by hand; bytes_up = 4 C D."""
    algo, eng, fed = make_algo("fedslr", ["algo.rank_penalty=0.03"])
    spec, D, P = eng.spec, eng.n_state, eng.n_params
    sizes = {e.name: tuple(e.shape) for e in spec.params}
    n_1d = sum(e.stop - e.start for e in spec.params if len(e.shape) < 2)
    history = []
    for t, clients in enumerate([[0, 1, 2], [0, 2], [1]]):
        start = {r.name: r.rank for r in algo.ranks}
        info = algo.round(t, np.array(clients))
        history.append((start, {r.name: r.rank for r in algo.ranks}))
        gkr = n_1d
        for name, r in start.items():
            m, n = sizes[name]  # the MLP's Linear weights: (out, in)
            gkr += min(r * (m + n), m * n)
        C = len(clients)
        assert info.comm.bytes_down == 4 * C * (gkr + D - P), t
        assert info.comm.bytes_up == 4 * C * D
    # the ranks moved during a round, so start and end ranks give different sizes
    assert any(a != b for a, b in history)


@pytest.mark.quick
def test_nnz_count_tracks_p_through_rounds():
    algo, eng, fed = make_algo("fedslr", ["algo.sparse_penalty=0.5"])
    for t, clients in enumerate([[0, 1], [2], [1, 2]]):
        info = algo.round(t, np.array(clients))
        nnz = (algo.p != 0).sum(1)
        assert torch.equal(algo.p_nnz.cpu(), nnz.cpu()), t
        gkr = info.diagnostics["gkr_params"]
        assert info.diagnostics["mixed_params"] == pytest.approx(gkr + float(nnz.float().mean()))
        assert info.diagnostics["p_density"] == pytest.approx(
            float(nnz.float().mean()) / eng.n_params
        )


@pytest.mark.quick
def test_checkpoint_round_trip():
    algo, eng, fed = make_algo("fedslr", ["algo.rank_penalty=0.002"])
    algo.round(0, np.array([0, 2]))
    state = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in algo.state_dict().items()
    }
    other, _, _ = make_algo("fedslr", ["algo.rank_penalty=0.002"], fed=fed)
    other.load_state_dict(state)
    algo.round(1, np.array([1, 2]))
    other.round(1, np.array([1, 2]))
    assert torch.equal(algo.p_nnz.cpu(), other.p_nnz.cpu())
    for k in ("theta", "lam", "h", "p"):
        assert torch.allclose(getattr(algo, k), getattr(other, k), atol=1e-6), k


# ------------------------------------------------------------------ real FMNIST
@pytest.mark.slow
def test_fedslr_learns_fmnist_and_gkr_becomes_low_rank(tmp_path):
    # 20 clients pat-2, MLP 784-64-10, 5 rounds; the rank penalty scaled to this run
    # (lambda_r = 0.01, tau = 0.1: the paper's 1e-4 barely moves an MLP in 5 rounds)
    summary, run = run_small(
        tmp_path,
        ["algo=fedslr", "optim.lr=0.05", "algo.rank_penalty=0.01", "algo.sparse_penalty=0.01"],
        rounds=5,
    )
    final = summary["final"]
    assert final["personal"]["L"]["avg"] > 0.85  # chance 0.5 on a client's 2 classes
    assert final["global"]["L"]["avg"] > 0.4  # chance 0.1 over 10 classes
    m = pd.read_csv(tmp_path / "metrics.csv").iloc[-1]
    ranks = {c: m[c] for c in m.index if c.startswith("rank.")}
    assert ranks["rank.body.fc1.weight"] < 64 or ranks["rank.head.weight"] < 10
    full = run.engine.n_params
    assert m["gkr_params"] < full
    assert summary["size"]["params_global_M"] == pytest.approx(m["gkr_params"] / 1e6)
    assert 0 < m["p_density"] < 1
    # downlink: the GKR factorized (at the rank of the round's start); uplink: the dense x_i
    assert summary["size"]["down_MB"] <= summary["size"]["up_MB"]


@pytest.mark.quick
def test_gram_solver_equals_svd():
    torch.manual_seed(1)
    for shape in [(2, 9, 4), (3, 5, 12)]:  # tall and wide, batched
        w = torch.randn(*shape)
        s = torch.linalg.svdvals(w.double())
        # tau halfway between the two middle singular values of the batch: some survive,
        # some do not, and none sits on the threshold. (tau = s.median() WAS a singular
        # value: the two solvers' last-bit errors then put it on either side of the
        # threshold, CPU-dependently; ranks [3, 2, 3] vs [2, 2, 3] on AMD EPYC.)
        v = s.flatten().sort().values
        k = v.numel() // 2
        tau = float(v[k - 1] + v[k]) / 2
        # both solvers recover singular values to ~1e-15 * ||W|| in float64 (the Gram
        # path squares them: ~eps ||W||^2 / s); the nearest one is 1e-6 ||W|| away at least
        # (here ~1e-2 ||W||), so the ranks cannot depend on rounding
        assert float((s - tau).abs().min()) > 1e-6 * float(s.max())
        a, ra = svt(w, tau, double=True)
        b, rb = svt_gram(w, tau)
        assert 0 < int(ra.sum()) < s.numel()
        assert torch.allclose(a, b, atol=1e-5)
        assert torch.equal(ra, rb)
    torch.manual_seed(0)
    model = ConvNet()
    spec = ModelSpec(model)
    w = spec.flatten(model)
    # tau = 0.3 is 3.7e-4 from conv2's nearest singular value (0.30038): the float32 SVD
    # ("svd") is accurate to ~1e-7 here, so the three solvers' ranks agree with room to spare
    assert_clear_of_threshold(w, spec, 0.3, margin=1e-5)
    ref, rref = nuclear_prox(w, spec, 0.3, solver="svd64")
    for solver in ("svd", "gram"):
        out, ranks = nuclear_prox(w, spec, 0.3, solver=solver)
        assert torch.allclose(out, ref, atol=1e-5), solver
        assert [r.rank for r in ranks] == [r.rank for r in rref]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedslr", "scaffold"])
def test_resume_after_crash_equals_uninterrupted(tmp_path, algo, monkeypatch):
    """Per-client state (lambda_i, h, p_i, ranks; c_i, c) through the runner's checkpoint:
    a run killed after round 5 and resumed from the round-3 checkpoint ends as one run."""
    from conftest import crash_and_resume

    over = [f"algo={algo}", "eval.every=2", "checkpoint.every=3", "participation=0.5"]
    if algo == "fedslr":
        over.append("algo.rank_penalty=0.01")
    full, out = crash_and_resume(tmp_path, monkeypatch, over, 6, die_at=5)
    assert {k: out[k] for k in ("final", "best", "size")} == {
        k: full[k] for k in ("final", "best", "size")
    }
