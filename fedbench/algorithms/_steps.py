"""The conventions of client step functions, for the client updates `Engine.train` cannot
express, and `clip_`.

pFedMe, Per-FedAvg, APPLE, FedSLR's Phase II, pFedHN, Ditto's interleaved mode and PLGU's
steps were per-client loops; each is now a step function, "gradient of some
state on a batch, then an optimizer step on some state", written on the engine's public
pieces: `Engine.batches` (the same batches as `Engine.train` for the same round/client/salt),
`Engine.grad_at` (training mode, as every training step) and `optim.step_`/`init_state`, plus
`clip_` here. They run client after client on the module; `Engine.client_steps` runs a step
function over all sampled clients at once where vmap can (every loop above is there;
`batch.grad(rows, at=, terms=)` gives SAM's second gradient and loss terms). `Engine.grad_at`
remains for one-client work outside a training loop (FedSpa's prune-and-grow gradient).

Optimizer state: a row a step function moves with an optimizer is declared to
`Engine.client_steps(..., optimized={name: Optimized(optim, lr, slot)})` and stepped with
`batch.step(name, g)`; the engine loads, carries and keeps its state in the store
`Engine.train` uses (fresh every round, or kept across rounds with `optim.persist_state`,
per slot and client; checkpointed with the engine, so an algorithm lists nothing for it in
`state_keys`), on either backend (`fedbench/engine/optimized.py`).

A state is a flat row [D] (parameters, then float buffers, `engine.spec`). `Engine.grad_at`
writes buffers updated by the forward (BatchNorm running statistics) back into the state, so
a state trained so evolves as it would under `Engine.train`; a perturbed evaluation
(`at=eps`) is done exactly as `Engine.train` does SAM: add eps in place, forward/backward,
subtract eps.
"""

from __future__ import annotations

import torch


def clip_(g: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """In-place `torch.nn.utils.clip_grad_norm_` semantics on a flat gradient [P], or on
    each row of [k, P] (the k clients of a `client_steps` step, each clipped by its norm)."""
    if max_norm:
        norm = g.norm() if g.dim() == 1 else g.norm(dim=-1, keepdim=True)
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return g
