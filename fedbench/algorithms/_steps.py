"""Hand-written local steps, for the client updates `Engine.train` cannot express.

PLGU-LF's coupled personal + universal step, PLGU-GRep's three-pass body step, Ditto's
interleaved steps and pFedHN's clipped inner steps are all
"gradient of some state on a batch, then an optimizer step on some state". This module is
that, once, on the engine's public pieces: `Engine.batches` (the same batches as
`Engine.train` for the same round/client/salt), `Engine.grad_at` (training mode, as every
training step) and `optim.step_`/`init_state`. They run client after client on the module;
`Engine.client_steps` runs a step function over all sampled clients at once where vmap can
(pFedMe and Per-FedAvg are there; the loops above are next).

Optimizer state: `engine.optim_states.get(cfg, slot, client, w)` before a client's steps and
`engine.optim_states.keep(cfg, slot, client, state)` after them, the store `Engine.train`
uses (fresh every round, or kept across rounds with `optim.persist_state`, per slot and
client; checkpointed with the engine, so an algorithm lists nothing for it in `state_keys`).

A state is a flat row [D] (parameters, then float buffers, `engine.spec`). `grad_at` writes
buffers updated by the forward (BatchNorm running statistics) back into the state, so a
state trained here evolves as it would under `Engine.train`; a perturbed evaluation
(`at=eps`) is done exactly as `Engine.train` does SAM: add eps in place, forward/backward,
subtract eps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedbench.engine import Engine, Term


def grad_at(
    engine: Engine,
    state: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    at: torch.Tensor | None = None,
    terms: Sequence[Term] = (),
    rows=(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient [P]) of `state` (evaluated at state + `at` when given) on (x, y), in
    training mode (BatchNorm on the batch's statistics, dropout on), whatever an evaluation
    left. The gradient is a tensor of its own (not the engine's buffer, which the next call
    overwrites). Updates `state`'s buffers (running statistics) as the forward did
    (`Engine.grad_at`)."""
    return engine.grad_at(state, x, y, at=at, terms=terms, rows=rows)


def clip_(g: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """In-place `torch.nn.utils.clip_grad_norm_` semantics on a flat gradient."""
    if max_norm:
        g.mul_(torch.clamp(max_norm / (g.norm() + 1e-6), max=1.0))
    return g
