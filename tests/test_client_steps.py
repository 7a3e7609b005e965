"""`Engine.client_steps`, the client-step vocabulary: a step function over explicit
per-client state, run client by client (sequential) or for all clients with a batch at once
(vmap, `torch.func`).

A plain SGD step written as a step function (`w <- w - lr * batch.grad(w)`) is exactly what
`Engine.train` does with SGD, so both must give the same states and per-client losses: on
TinyFed's MLP (clients of 37, 20 and 50 samples in batches of 8 over 2 epochs: 10, 6 and 14
steps, short last batches) and on a BatchNorm CNN with augmentation (running statistics
updated in place per client, one mapped call per batch length). Sequential: the same state
bits (one module, the same forwards); vmap: within the backends' tolerance.
"""

from __future__ import annotations

import pytest
import torch
from test_backends import ImageFed, bn_cnn

from conftest import TEST_DEVICE, TinyFed
from fedbench.engine import Engine, OptimConfig, Proximal
from fedbench.models import build_model

LR = 0.1


def engine(image: bool, backend: str) -> tuple[Engine, torch.Tensor]:
    """An engine on TinyFed's MLP or ImageFed's BatchNorm CNN, and 3 distinct client states."""
    fed = (ImageFed(True) if image else TinyFed()).to(TEST_DEVICE)
    torch.manual_seed(0)
    model = bn_cnn(fed) if image else build_model("mlp", fed.input_shape, 3, hidden=[8])
    eng = Engine(fed, model, device=TEST_DEVICE, backend=backend)
    states = eng.initial_state().repeat(3, 1)
    P = eng.n_params
    states[:, :P] += 0.01 * torch.randn(3, P, generator=torch.Generator().manual_seed(1)).to(
        states.device
    )
    return eng, states


def sgd_step(st, batch):
    loss, g = batch.grad(st["w"])  # updates the rows' running statistics
    st["w"][:, : g.shape[1]].sub_(g, alpha=LR)
    return st, loss


@pytest.mark.quick
@pytest.mark.parametrize("image", [False, True], ids=["mlp", "bn_cnn_augment"])
@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_an_sgd_step_function_is_engine_train(backend, image):
    eng, states = engine(image, backend)
    clients = [0, 1, 2]
    kw = dict(batch_size=8, epochs=2, round=3)
    res = eng.client_steps({"w": states}, clients, sgd_step, **kw)
    ref = eng.train(states, clients, optim=OptimConfig(lr=LR), lr=LR, **kw)
    assert res.steps == ref.steps and len(set(ref.steps)) == 3  # unequal step counts
    assert res.aux.shape[:2] == (max(ref.steps), 3)
    if backend == "sequential":
        assert torch.equal(res.states["w"], ref.states)
    else:
        torch.testing.assert_close(res.states["w"], ref.states, rtol=1e-4, atol=1e-5)
    # `train` sums its losses as it goes, `client_mean` takes one mean: the last bits differ
    torch.testing.assert_close(res.client_mean(), ref.loss, rtol=1e-4, atol=1e-5)
    assert not torch.equal(res.states["w"], states)  # it trained
    # the input rows are not written: the result is a copy
    assert torch.equal(states, engine(image, backend)[1])


@pytest.mark.quick
def test_step_index_and_rows_of_the_clients_still_stepping():
    """`batch.index` is the step's position; a step sees only the clients with that step."""
    eng, states = engine(False, "vmap")
    seen = []

    def step(st, batch):
        seen.append((batch.index, st["n"].shape[0]))
        st["n"] += 1
        return st, None

    counts = torch.zeros(3, 1, device=states.device)
    res = eng.client_steps({"n": counts}, [0, 1, 2], step, batch_size=8, epochs=1)
    assert res.steps == [5, 3, 7] and res.aux is None
    assert res.states["n"].flatten().tolist() == [5.0, 3.0, 7.0]
    # longest first: at steps 0-2 all three, 3-4 two, 5-6 one
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 2), (4, 2), (5, 1), (6, 1)]


@pytest.mark.quick
def test_auto_runs_step_functions_sequentially_on_a_cpu_and_batched_on_cuda(monkeypatch):
    """On a CPU a step function's [k, P] row updates outgrow the cache (pFedMe was slower on
    vmap), so auto keeps it client by client (bit-identical to the loops it replaced); train
    calls still map the MLP; on CUDA both map."""
    fed = TinyFed()
    eng = Engine(fed, build_model("mlp", fed.input_shape, 3, hidden=[8]), device="cpu")
    assert eng.backend_for(3, client_steps=True) == "sequential"
    assert eng.backend_for(3) == "vmap"
    # APPLE's step reads one shared matrix: batched products win on a CPU too
    assert eng.backend_for(3, client_steps=True, batched_on_cpu=True) == "vmap"
    monkeypatch.setattr(eng, "device", torch.device("cuda"))
    assert eng.backend_for(3, client_steps=True) == "vmap"


MU = 0.7


def perturbed_prox_step(st, batch):
    """One gradient at w + at with the proximal term (mu / 2) ||w + at - ref||^2, each
    client's own `at` and `ref` rows; the gradient is kept in the state, the loss as aux."""
    loss, g = batch.grad(st["w"], at=st["at"], terms=[Proximal(st["ref"], MU)])
    st["g"].copy_(g)
    return st, loss


def by_hand(eng: Engine, state, at, ref, x, y):
    """(loss, gradient, buffers after the forward) of CE + (mu / 2) ||w + at - ref||^2 at
    w + at, by autograd on the model called functionally (training mode)."""
    P = eng.n_params
    w = (state[:P] + at).detach().requires_grad_(True)
    bufs = state[P:].clone()
    eng.model.train()
    logits = eng.functional_logits(w, x, bufs)  # updates the running statistics in bufs
    loss = torch.nn.functional.cross_entropy(logits, y) + 0.5 * MU * ((w - ref[:P]) ** 2).sum()
    (g,) = torch.autograd.grad(loss, w)
    return loss.detach(), g, bufs


@pytest.mark.quick
@pytest.mark.parametrize("image", [False, True], ids=["mlp", "bn_cnn_augment"])
def test_batch_grad_at_a_perturbation_with_terms(image):
    """`batch.grad(states, at=, terms=)` on both backends: each client's gradient at its
    w + at of its cross-entropy plus a per-client proximal term equals autograd by hand on
    the same batch (clients of 8, 6 and 8 samples on the CNN: two groups of batch lengths on
    vmap), the running statistics updated as that forward updates them, and the parameters
    left where they were."""
    out = {}
    for backend in ("sequential", "vmap"):
        eng, states = engine(image, backend)
        gen = torch.Generator().manual_seed(2)
        P = eng.n_params
        at = (0.05 * torch.randn(3, P, generator=gen)).to(states.device)
        ref = states + torch.randn(states.shape, generator=gen).to(states.device)
        st = {"w": states, "at": at, "ref": ref, "g": torch.zeros_like(at)}
        res = eng.client_steps(st, [0, 1, 2], perturbed_prox_step, batch_size=8, steps=1, round=4)
        assert eng.backend_for(3, client_steps=True) == backend
        for c in range(3):
            ((x, y),) = eng.batches(c, 8, steps=1, round=4)
            loss, g, bufs = by_hand(eng, states[c], at[c], ref[c], x, y)
            torch.testing.assert_close(res.aux[0, c], loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(res.states["g"][c], g, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(res.states["w"][c, P:], bufs, rtol=1e-5, atol=1e-6)
            # the parameters stay (sequential adds `at` and subtracts it: the last bits move)
            torch.testing.assert_close(res.states["w"][c, :P], states[c, :P])
        if image:
            assert not torch.equal(res.states["w"][:, P:], states[:, P:])  # statistics moved
        out[backend] = res
    seq, vm = out["sequential"], out["vmap"]
    torch.testing.assert_close(vm.states["g"], seq.states["g"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(vm.states["w"], seq.states["w"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vm.aux, seq.aux, rtol=1e-5, atol=1e-6)
