"""Loss terms in closed form (`Term.value_and_grad`) against autograd over `Term.value`.

The engines add a closed-form term's gradient after the model's instead of differentiating
the term with the model; these tests hold that route to the bits of the autograd one, on one
client ([P]) and batched ([k, P], shared and per-client rows), and show that a term without a
closed form still trains (through autograd) on both backends alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from fedbench.engine.terms import (
    Linear,
    Proximal,
    Term,
    closed_form,
    correction,
    dynamic,
    values_and_grad,
)

pytestmark = pytest.mark.quick


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.view(-1).view(torch.int32), b.view(-1).view(torch.int32)
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.ReLU(), torch.nn.Linear(9, 4))


def _views(model, w):
    out, i = {}, 0
    for n, p in model.named_parameters():
        out[n] = w[i : i + p.numel()].view(p.shape)
        i += p.numel()
    return out


def _cases(k: int, P: int):
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(k, P + 3, generator=g)  # a full state [D]: only its first P entries count
    lam = torch.randn(k, P, generator=g) * 0.1
    c, ci = torch.randn(P, generator=g), torch.randn(k, P, generator=g)
    return {
        "proximal per client": [Proximal(ref, 0.37)],
        "proximal shared": [Proximal(ref[0], 0.01)],
        "dynamic (linear + proximal)": dynamic(lam, ref[:, :P], 0.0113),
        "correction": [correction(ci, c)],
        "three terms": [Linear(lam), Proximal(ref, 0.2), Proximal(ref[-1], 1.7)],
    }


CASES = list(_cases(1, 1))


@pytest.mark.parametrize("case", CASES)
def test_closed_form_equals_autograd_batched(case):
    """The vmap backend's route: the model's mapped gradient, then the terms over [k, P]
    (their values added in order, their gradients summed as autograd accumulates them)
    equals mapping autograd over cross-entropy + terms, to the bit."""
    model = _model()
    P, k = sum(p.numel() for p in model.parameters()), 5
    terms = _cases(k, P)[case]
    assert closed_form(terms)
    g = torch.Generator().manual_seed(2)
    W = torch.randn(k, P, generator=g) * 0.3
    x, y = torch.randn(k, 8, 12, generator=g), torch.randint(0, 4, (k, 8), generator=g)
    tensors = [v for t in terms for v in t.tensors()]
    dims = [0 if pc else None for t in terms for pc in t.per_client]

    def ce(w, x, y):
        return F.cross_entropy(functional_call(model, _views(model, w), (x,)), y)

    def full(w, x, y, *ts):
        val = ce(w, x, y)
        for t, v in zip(terms, ts):  # every term here has one tensor
            val = val + t.value(w, v)
        return val

    g_ref, v_ref = vmap(grad_and_value(full), in_dims=(0, 0, 0, *dims))(W, x, y, *tensors)
    g, v = vmap(grad_and_value(ce))(W, x, y)
    values, gt = values_and_grad(W, terms, [t.tensors() for t in terms])
    for val in values:
        v = v + val
    g = g.add_(gt)
    assert _bits_equal(g, g_ref)
    assert _bits_equal(v, v_ref)


@pytest.mark.parametrize("case", CASES)
def test_closed_form_equals_autograd_one_client(case):
    """The sequential route (`FlatModule._terms_grad`): one client's rows, the terms'
    values summed as Python's sum, the gradient as autograd's of that sum."""
    P, k = 40, 3
    terms = _cases(k, P)[case]
    w = torch.randn(P, generator=torch.Generator().manual_seed(3))
    for c in range(k):
        rows = [t.rows(c) for t in terms]
        wl = w.clone().requires_grad_(True)
        val = sum(t.value(wl, *r) for t, r in zip(terms, rows))
        (g_ref,) = torch.autograd.grad(val, wl)
        values, g = values_and_grad(w, terms, rows)
        assert _bits_equal(g, g_ref)
        assert _bits_equal(sum(values), val.detach())


def test_proximal_and_linear_by_hand():
    """(mu/2)||w - ref||^2 and <v, w> and their gradients, against hand-computed values."""
    w = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    ref = torch.tensor([[0.0, 1.0], [1.5, -1.0]])
    v, g = Proximal(ref, 2.0).value_and_grad(w, ref)
    assert torch.allclose(v, torch.tensor([2.0, 1.0]))  # 0.5 * 2 * (1 + 1), 0.5 * 2 * 1
    assert torch.allclose(g, torch.tensor([[2.0, 2.0], [-2.0, 0.0]]))
    lin = Linear(torch.tensor([3.0, -1.0]))
    v, g = lin.value_and_grad(w, lin.v)
    assert torch.allclose(v, torch.tensor([1.0, 2.5]))
    assert torch.equal(g, torch.tensor([[3.0, -1.0], [3.0, -1.0]]))


class _AutogradProximal(Proximal):
    """Proximal without its closed form: the engines differentiate its `value`."""

    value_and_grad = Term.value_and_grad


class _AutogradLinear(Linear):
    value_and_grad = Term.value_and_grad


class _Huber(Term):
    """A term with no closed form at all."""

    per_client = (False,)

    def __init__(self, ref: torch.Tensor) -> None:
        self.ref = ref

    def tensors(self):
        return (self.ref,)

    def value(self, w, ref):
        return 0.5 * F.huber_loss(w, ref[: w.shape[-1]], reduction="sum", delta=0.05)


def _train(tiny_fed, backend: str, make_terms, steps: bool = False):
    from fedbench.engine import Engine, OptimConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    eng = Engine(tiny_fed, model, device="cpu", seed=1, backend=backend)
    w0 = eng.initial_state()
    g = torch.Generator().manual_seed(4)
    ref = w0 + 0.1 * torch.randn(3, w0.numel(), generator=g)
    lam = 0.01 * torch.randn(3, w0.numel(), generator=g)
    optim = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)
    return eng.train(
        w0, [0, 1, 2], optim=optim, lr=0.1, batch_size=8, epochs=2, terms=make_terms(ref, lam)
    )


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_engine_closed_route_equals_autograd_route(tiny_fed, backend):
    """FedDyn's two terms (per-client rows) with momentum and weight decay: the engine's
    closed-form route and its autograd route give the same states and losses, to the bit."""
    closed = _train(tiny_fed, backend, lambda ref, lam: [Linear(-lam), Proximal(ref, 0.3)])
    auto = _train(
        tiny_fed, backend, lambda ref, lam: [_AutogradLinear(-lam), _AutogradProximal(ref, 0.3)]
    )
    assert _bits_equal(closed.states, auto.states)
    assert _bits_equal(closed.loss, auto.loss)


def test_term_without_closed_form_on_both_backends(tiny_fed):
    """A term with no closed form goes through autograd on both backends, which agree."""
    assert not _Huber.has_closed_form() and Proximal.has_closed_form()
    seq = _train(tiny_fed, "sequential", lambda ref, lam: [_Huber(ref[0])])
    vm = _train(tiny_fed, "vmap", lambda ref, lam: [_Huber(ref[0])])
    free = _train(tiny_fed, "sequential", lambda ref, lam: [])
    torch.testing.assert_close(vm.states, seq.states, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(seq.states, free.states)  # the term did pull
