"""Server-side training: a module (or any pure function of named parameters) fitted on the
tensors clients uploaded, as FedGH's server trains its global header on the clients' class
means. The clients' training is `Engine.train`; this is the server's half, in the same
vocabulary (the run's `OptimConfig` and `step_`, minibatches drawn from a keyed generator,
so a resumed run draws what an uninterrupted one does and nothing but the returned tensors
carries state to the next round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from fedbench.engine.optim import OptimConfig, init_state, step_


def fit_on_server(
    params: Mapping[str, torch.Tensor],
    forward: Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    optim: OptimConfig | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`epochs` passes over the uploaded (x [M, ...], y [M]) in a random order drawn from
    `generator` (a CPU one, keyed: `algorithms._shared.keyed_generator`), minibatches of
    `batch_size` (the last one shorter), each a step on loss(forward(params, x_b), y_b):
    plain SGD p <- p - lr g without `optim`, else that optimizer (`step_`, its state fresh
    for this fit). Returns the new parameters (fresh tensors; `params` is left as it was)
    and the mean loss over the steps (0-d). `forward` is a pure function of the parameters
    (`F.linear`, `torch.func.functional_call(module, params, x)`)."""
    cur = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    states = {k: init_state(optim, v.detach().view(-1)) for k, v in cur.items()} if optim else {}
    total, steps = x.new_zeros(()), 0
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=generator).to(x.device)
        for s in range(0, x.shape[0], batch_size):
            b = order[s : s + batch_size]
            value = loss(forward(cur, x[b]), y[b])
            grads = torch.autograd.grad(value, list(cur.values()))
            with torch.no_grad():
                for (k, p), g in zip(cur.items(), grads):
                    if optim is None:
                        p.sub_(lr * g)
                    else:
                        step_(optim, p.view(-1), g.reshape(-1), states[k], lr, consume_grad=True)
            total, steps = total + value.detach(), steps + 1
    return {k: v.detach() for k, v in cur.items()}, total / max(steps, 1)
