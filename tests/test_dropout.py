"""Keyed dropout (`fedbench.models.dropout`): masks from (seed, round, client, salt, batch,
layer), the same on both engine backends.

The mask function alone (one client's forward equals the same client inside a vmapped
forward; the fraction dropped; different masks for other clients, batches, rounds and
layers; no dropout in evaluation), then the engine: `train` (with SAM), `client_steps` and
`full_grads` give the same numbers on vmap as sequentially on an MLP with dropout and on a
small WideResNet with dropout 0.3, and the dropout is real (the result moves with the seed
of the masks). WRN with dropout 0 keeps no dropout module at all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import vmap

from conftest import TinyFed
from fedbench.engine import SAM, Engine
from fedbench.engine.optim import OptimConfig
from fedbench.engine.schedule import Schedule
from fedbench.models import build_model
from fedbench.models.dropout import KeyedDropout, dropout_key, keep_mask, mix32


def drop_all(d: nn.Module, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    with dropout_key(key):
        return d(x)


@pytest.mark.quick
def test_mix32_is_lowbias32():
    # the reference values of Wellons' lowbias32 (uint32 arithmetic, computed by hand in
    # Python ints mod 2^32): the int64 tensor form must give the same
    def ref(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x7FEB352D) % 2**32
        h ^= h >> 15
        h = (h * 0x846CA68B) % 2**32
        return h ^ (h >> 16)

    xs = [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    got = mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [ref(x) for x in xs]
    assert all(0 <= v < 2**32 for v in got)


@pytest.mark.quick
def test_one_client_alone_and_inside_vmap_draw_the_same_mask():
    d = KeyedDropout(0.3)
    xs = torch.randn(3, 3, 5, 7)  # 105 elements per client: an odd count (a lone half)
    keys = torch.tensor([7, 8, 2**32 - 1])
    mapped = vmap(lambda x, k: drop_all(d, x, k))(xs, keys)
    alone = torch.stack([drop_all(d, xs[c], keys[c]) for c in range(3)])
    assert torch.equal(mapped, alone)
    # padding samples appended to a batch leave the real samples' masks as they were
    padded = torch.cat([xs[0], torch.randn(2, 5, 7)])
    assert torch.equal(drop_all(d, padded, keys[0])[:3], alone[0])


@pytest.mark.quick
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_fraction_asked_is_dropped_and_kept_values_are_scaled(p):
    d = KeyedDropout(p)
    x = torch.ones(100, 1000)
    out = drop_all(d, x, torch.tensor(42))
    dropped = float((out == 0).float().mean())
    assert abs(dropped - p) < 0.01  # 1e5 elements: std <= 0.0016
    assert torch.allclose(out[out != 0], torch.tensor(1 / (1 - p)))
    assert float(drop_all(d, x, torch.tensor(43)).mean()) == pytest.approx(1, abs=0.03)


@pytest.mark.quick
def test_masks_differ_between_clients_batches_rounds_and_layers():
    sched = Schedule(TinyFed(), torch.device("cpu"), seed=5, dropout=True)
    keys = {
        "c0": sched.keys(0, 2)[0],
        "c0 batch 1": sched.keys(0, 2)[1],
        "c1": sched.keys(1, 2)[0],
        "c0 round 1": sched.keys(0, 2, round=1)[0],
        "c0 salt 1": sched.keys(0, 2, salt=1)[0],
    }
    assert torch.equal(sched.keys(0, 2), sched.keys(0, 5)[:2])  # a prefix: stable
    assert Schedule(TinyFed(), torch.device("cpu"), seed=5).keys(0, 2) is None  # no dropout
    p, shape = 0.3, (50, 200)
    masks = {n: keep_mask(k, 0, shape, p) for n, k in keys.items()}
    masks["c0 layer 1"] = keep_mask(keys["c0"], 1, shape, p)
    names = list(masks)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            agree = float((masks[a] == masks[b]).float().mean())
            # independent masks agree on p^2 + (1-p)^2 = 0.58 of the elements
            assert 0.54 < agree < 0.62, (a, b, agree)


@pytest.mark.quick
def test_evaluation_does_not_drop_and_an_unkeyed_forward_uses_torch_generator():
    d = KeyedDropout(0.5)
    x = torch.randn(8, 16)
    d.eval()
    assert torch.equal(drop_all(d, x, torch.tensor(1)), x)
    d.train()
    # outside a keyed block (an algorithm's own forward): nn.Dropout's draws
    torch.manual_seed(0)
    ours = d(x)
    torch.manual_seed(0)
    assert torch.equal(ours, nn.Dropout(0.5)(x))
    # a keyed block left by None stays keyed, and two calls in one block draw two masks
    with dropout_key(torch.tensor(3)):
        a = d(x)
        with dropout_key(None):
            b = d(x)
    assert not torch.equal(a, b)
    assert torch.equal(a, drop_all(d, x, torch.tensor(3)))


def mlp_dropout(fed, p: float = 0.3) -> nn.Module:
    return nn.Sequential(
        nn.Linear(fed.input_shape[0], 16), nn.ReLU(), KeyedDropout(p), nn.Linear(16, 8),
        nn.ReLU(), KeyedDropout(p), nn.Linear(8, fed.num_classes),
    )  # fmt: skip


class ImageFed(TinyFed):
    """3 clients of 1x6x6 images (13, 6 and 17 samples: short last batches)."""

    def __init__(self) -> None:
        super().__init__(sizes=(13, 6, 17), dim=36)
        self.x = self.x.view(-1, 1, 6, 6)
        self.input_shape = (1, 6, 6)


def wrn_dropout(fed, p: float = 0.3) -> nn.Module:
    return build_model(
        "wrn28_10", fed.input_shape, fed.num_classes, depth=10, widen=1, dropout=p, norm="group"
    )


def engines(fed, model_fn, **kw) -> dict[str, Engine]:
    out = {}
    for backend in ("sequential", "vmap"):
        torch.manual_seed(0)
        out[backend] = Engine(fed, model_fn(fed), device="cpu", backend=backend, seed=7, **kw)
    return out


def train(eng: Engine, round: int = 3, epochs: int = 2, **kw):
    init = eng.initial_state()
    states = init + 0.01 * torch.randn(3, init.numel(), generator=torch.Generator())
    return eng.train(
        states, [0, 1, 2], optim=OptimConfig(momentum=0.9), lr=0.1, batch_size=8,
        epochs=epochs, round=round, **kw,
    )  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("model,sam", [("mlp", False), ("mlp", True), ("wrn", False)])
def test_train_is_the_same_on_both_backends(model, sam):
    fed, fn = (TinyFed(), mlp_dropout) if model == "mlp" else (ImageFed(), wrn_dropout)
    kw = {"sam": SAM(rho=0.05)} if sam else {}
    res = {}
    for name, eng in engines(fed, fn).items():
        assert eng.backend_for(3) == name  # keyed dropout: vmap runs it
        res[name] = train(eng, epochs=2 if model == "mlp" else 1, **kw)
    seq, vm = res["sequential"], res["vmap"]
    torch.testing.assert_close(vm.states, seq.states, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(vm.loss, seq.loss, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
def test_the_masks_move_the_result_and_carry_no_state():
    eng = engines(TinyFed(), mlp_dropout)["sequential"]
    first = train(eng).states
    assert torch.equal(train(eng).states, first)  # keyed: nothing carried between calls
    assert not torch.allclose(train(eng, round=4).states, first, atol=1e-4)  # other keys
    # a model without the dropout trains to other states from the same start
    torch.manual_seed(0)
    plain = Engine(TinyFed(), mlp_dropout(TinyFed(), p=0.0), device="cpu", seed=7)
    assert not torch.allclose(train(plain).states, first, atol=1e-4)


@pytest.mark.quick
@pytest.mark.parametrize("model", ["mlp", "wrn"])
def test_client_steps_and_full_grads_are_the_same_on_both_backends(model):
    fed, fn = (TinyFed(), mlp_dropout) if model == "mlp" else (ImageFed(), wrn_dropout)
    out = {}
    for name, eng in engines(fed, fn).items():
        init = eng.initial_state().expand(3, -1).clone()
        P = eng.n_params

        def step(st, batch, P=P):
            loss, g = batch.grad(st["w"])
            w = st["w"].clone()
            w[:, :P] -= 0.1 * g
            return {"w": w}, loss

        steps = eng.client_steps({"w": init}, [0, 1, 2], step, batch_size=8, epochs=1, round=2)
        grads = eng.full_grads(steps.states["w"], [0, 1, 2], block=16)
        out[name] = (steps.states["w"], steps.aux, grads.loss, grads.grads)
    for a, b in zip(out["sequential"], out["vmap"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
def test_wrn_without_dropout_has_no_dropout_module():
    fed = ImageFed()
    model = wrn_dropout(fed, p=0.0)
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
    # depth 10: one block per stage, one dropout per block
    assert sum(isinstance(m, KeyedDropout) for m in wrn_dropout(fed).modules()) == 3
