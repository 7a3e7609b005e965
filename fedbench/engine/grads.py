"""Full-batch losses and gradients of many clients at given states (FedPG's client reports).

`full_grads(engine, states, clients)` returns, for every client c of the call, the mean
cross-entropy F_c(w_c) over its whole training set and its gradient grad F_c(w_c) [P], from
one call: on the vmap backend all clients go through one batched computation per block of
samples (clients' data padded to the longest, padding weighted 0, each real sample weighted
1/n_c, so a client's weighted sum is its mean loss); on the sequential backend one module
is reused client by client. The choice is `Engine.backend_for`'s (vmap needs a model
without float buffers and dropout).

`full_losses` is the same pass without gradients (S-FedPG's line-search loss queries).

Samples are read with `train=False` (no augmentation): the gradient is the one of F_c, not
of a random augmented copy. The module runs in training mode on the sequential backend
(BatchNorm normalizes with the block's statistics and updates its running statistics;
the buffers after the pass come back as `GradResult.buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

if TYPE_CHECKING:
    from fedbench.engine.core import Engine


@dataclass
class GradResult:
    loss: torch.Tensor  # [C] mean training loss of each client at its state
    grads: torch.Tensor | None  # [C, P] gradient of that loss (None for losses only)
    buffers: torch.Tensor  # [C, D - P] buffers after the pass (unchanged on vmap)


def _rows(states: torch.Tensor, C: int) -> torch.Tensor:
    return states.expand(C, -1) if states.dim() == 1 else states


def full_grads(
    engine: Engine,
    states: torch.Tensor,
    clients: Sequence[int],
    *,
    with_grad: bool = True,
    block: int | None = None,
) -> GradResult:
    """Loss (and gradient) of client `clients[c]`'s whole training set at row c of `states`
    ([C, D], or one [D] shared by all); `block` samples per client per batched pass
    (default: the engine's evaluation batch size)."""
    clients = [int(c) for c in clients]
    C = len(clients)
    states = _rows(states, C)
    block = int(block or engine.eval_batch_size)
    if C == 0:
        P = engine.n_params
        empty = torch.zeros(0, device=engine.device)
        return GradResult(empty, torch.zeros(0, P) if with_grad else None, states[:, P:])
    if engine.backend_for(C) == "vmap":
        return _vmap(engine, states, clients, with_grad, block)
    return _sequential(engine, states, clients, with_grad, block)


def full_losses(engine: Engine, states: torch.Tensor, clients: Sequence[int]) -> torch.Tensor:
    """[C] mean training loss of each client at its row of `states` (no gradient)."""
    return full_grads(engine, states, clients, with_grad=False).loss


def _sequential(engine, states, clients, with_grad, block) -> GradResult:
    P, dev = engine.n_params, engine.device
    C = len(clients)
    losses = torch.zeros(C, device=dev)
    grads = torch.zeros(C, P, device=dev) if with_grad else None
    bufs = states[:, P:].clone()
    model = engine.model
    model.train()
    for c, client in enumerate(clients):
        engine.load(states[c])
        pool = engine.fed.train_idx[client]
        n = int(pool.numel())
        if n == 0:
            continue
        engine._g.zero_()
        for s in range(0, n, block):
            x, y = engine.fed.batch(pool[s : s + block], train=False)
            if with_grad:
                loss = F.cross_entropy(model(x), y, reduction="sum") / n
                loss.backward()  # accumulates into engine._g (the module's .grad views)
            else:
                with torch.no_grad():
                    loss = F.cross_entropy(model(x), y, reduction="sum") / n
            losses[c] += loss.detach()
        if with_grad:
            grads[c] = engine._g
        bufs[c] = engine._flat[P:]
    return GradResult(losses, grads, bufs)


def _vmap(engine, states, clients, with_grad, block) -> GradResult:
    P, dev = engine.n_params, engine.device
    C = len(clients)
    model, spec = engine.model, engine.spec
    pools = [engine.fed.train_idx[c] for c in clients]
    sizes = torch.tensor([int(p.numel()) for p in pools], device=dev)
    n_max = int(sizes.max())
    idx = torch.zeros(C, n_max, dtype=torch.long, device=dev)
    for c, p in enumerate(pools):
        idx[c, : p.numel()] = p.to(dev)
    wt = (torch.arange(n_max, device=dev)[None, :] < sizes[:, None]).float()
    wt = wt / sizes.clamp(min=1)[:, None].float()

    def loss(w, x, y, wc):
        logits = functional_call(model, spec.param_views(w), (x,))
        return (F.cross_entropy(logits, y, reduction="none") * wc).sum()

    fn = vmap(grad_and_value(loss)) if with_grad else vmap(loss)
    # clients per chunk: parameter rows and one block of activations each
    vb = engine._vmap
    if vb._per_sample is None:
        vb._per_sample = vb._probe()
    data, act = vb._per_sample
    k = vb.chunk_size(C, 6 * P * 4 + block * (data + 3 * act))
    losses = torch.zeros(C, device=dev)
    grads = torch.zeros(C, P, device=dev) if with_grad else None
    model.train()
    for lo in range(0, C, k):
        W = states[lo : lo + k, :P]
        kc = W.shape[0]
        for s in range(0, n_max, block):
            ib = idx[lo : lo + k, s : s + block]
            b = ib.shape[1]
            x, y = engine.fed.batch(ib.reshape(-1), train=False)
            x, y = x.view(kc, b, *x.shape[1:]), y.view(kc, b)
            wb = wt[lo : lo + k, s : s + block]
            if with_grad:
                g, v = fn(W, x, y, wb)
                grads[lo : lo + k] += g
            else:
                with torch.no_grad():
                    v = fn(W, x, y, wb)
            losses[lo : lo + k] += v.detach()
    return GradResult(losses, grads, states[:, P:].clone())
