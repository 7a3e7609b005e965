"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal: "Federated Multi-Task Learning under a
Mixture of Distributions", NeurIPS 2021, arXiv:2108.10252; authors' code omarfoq/FedEM).

Each client's distribution is a mixture of M shared components: client t's model is
p_t(y | x) = sum_m pi_tm p_m(y | x; theta_m), with M shared component models theta_m (every
client's, averaged by the server) and mixture weights pi_t [M] that never leave the client
(`components` = M, the paper's default 3; pi_t starts uniform, 1/M).

Round k (Algorithm 1, FedEM; its details in Algorithm 2 of the appendix), for each sampled
client t from the components theta_m^{k-1} the server sent, on its n_t training samples:

    E-step:  q_t(z_i = m) = pi_tm^{k-1} exp(-l(h_m(x_i), y_i))
                            / sum_m' pi_tm'^{k-1} exp(-l(h_m'(x_i), y_i))
    M-step:  pi_tm^k = (1 / n_t) sum_i q_t(z_i = m)
             theta_m,t^k = LocalSolver: E epochs of the run's optimizer, from theta_m^{k-1},
                           on (1 / B) sum_{i in batch} q_t(z_i = m) l(h_m(x_i), y_i)

with l the cross-entropy (the sample's negative log-likelihood, so exp(-l) = p_m(y_i | x_i)).
The server averages each component: theta_m^k = sum_t w_t theta_m,t^k, w_t = n_t / n over
the sampled clients (`weighting: samples`; or 1/C), through `server_step` (server_opt
applies per component). Client t predicts argmax_y sum_m pi_tm softmax(h_m(x))_y; a client
never sampled keeps pi = 1/M.

The weighted loss goes through the engine as a custom objective. The engine's objective
receives (model, x, y, c), not the batch's sample indices, so q is not looked up from the
E-step's table: the objective recomputes q for the batch from the same frozen round-start
components (evaluation mode, no gradient) and pi^{k-1}; q_t(z_i = m) depends only on
(x_i, y_i), theta^{k-1} and pi^{k-1}, so this is the E-step's value at those samples
(tests/test_fedem.py checks it against the table), at the cost of M extra forwards per step.

RECONSTRUCTION (the paper leaves these open; the authors' code decides):
- the E-step's losses are those of the components in evaluation mode (BatchNorm on its
  running statistics, no dropout) on the un-augmented training samples, and the local
  objective is the batch mean of q * loss (the authors' `(loss_vec @ weights) / B`); with
  `data.augment` the objective's q is that of the augmented sample it trains on;
- each component has its own batch order (the authors' learners each iterate the shuffled
  loader; here `salt=m`) and its own optimizer state (slot `component<m>`);
- the M components start from M independent initializations (the authors build each
  learner with its own random init; identical ones would stay identical: q = pi, equal
  gradients): component 0 is the run's initial model, component m >= 1 `model_fn()` under
  a seed drawn from (run seed, m);
- partial participation (`aggregate`; the paper's Algorithm 1 has every client take part):
  `all` (default, the authors' `CentralizedAggregator.mix`) averages all N clients' copies,
  the unsampled ones holding the broadcast model, with weights n_t / n over all N, i.e.
  theta_m^k = theta_m^{k-1} + s (avg_S - theta_m^{k-1}) with avg_S the sampled clients'
  average and s their share of the weight (sum_{t in S} n_t / n, or C / N uniform);
  `sampled` averages the sampled clients only (FedAvg's rule, FL-bench's), a step 1/s
  longer; with every client sampled the two are the same;
- the training loss reported is sum_m of each component's mean weighted loss (the M-step's
  objective), averaged over the sampled clients.
Uploads: the M trained component states of each client (kind "model", ref = the component
it trained from); pi stays on the client. Communication: M full states each way.
Buffers: each component's running statistics are updated by its own training forwards and
averaged with its parameters (weights n_t / n, the authors' `average_learners`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp
from fedbench.engine import client_row
from fedbench.engine.plan import Objective


@dataclass
class FedEMParams:
    components: int = hp(ge=1)  # M shared component models (the paper's default 3)
    weighting: Weighting  # each component's average: samples (n_t / n) | uniform (1/C)
    aggregate: Literal["all", "sampled"]  # all N clients' copies (authors') | the sampled only


def e_step(log_pi: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """q [n, M]: q_i(m) = pi_m exp(-losses[m, i]) / sum_m' pi_m' exp(-losses[m', i]) from
    log_pi [M] (log pi^{k-1}) and each component's per-sample losses [M, n]."""
    return torch.softmax(log_pi[:, None] - losses, dim=0).T


def weighted_objective(spec, frozen: torch.Tensor, log_pi: torch.Tensor, m: int) -> Objective:
    """The M-step's local objective of component m for the clients of a train call:
    (1 / B) sum_i q(z_i = m) l(h_m(x_i), y_i), with q the E-step's responsibilities of the
    batch's samples under the frozen round-start components `frozen` [M, D] and the client's
    log pi^{k-1} (`log_pi` [C, M], row c for the call's client c)."""
    P = spec.n_params
    views = [spec.views(s[:P], s[P:]) for s in frozen]

    def objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: int) -> torch.Tensor:
        with torch.no_grad():
            model.eval()  # the E-step's evaluation mode (running statistics, no dropout)
            logits = [functional_call(model, v, (x,)) for v in views]
            losses = torch.stack([F.cross_entropy(z, y, reduction="none") for z in logits])
            model.train()
            q = e_step(client_row(log_pi, c), losses)[:, m]
        return (q * F.cross_entropy(model(x), y, reduction="none")).mean()

    return objective


class Mixture(nn.Module):
    """Client t's deployed predictor: M component models and pi_t; forward returns
    log sum_m pi_m softmax(h_m(x)) (the mixture's log-probabilities)."""

    def __init__(self, components: list[nn.Module], pi: torch.Tensor) -> None:
        super().__init__()
        self.components = nn.ModuleList(components)
        self.register_buffer("pi", pi.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = torch.stack([F.log_softmax(h(x), dim=-1) for h in self.components])
        return torch.logsumexp(logp + self.pi.log()[:, None, None], dim=0)


@ALGORITHMS.register()
class FedEM(Algorithm):
    about = About(
        name="FedEM",
        paper="Marfoq et al., NeurIPS 2021",
        summary=(
            "M shared component models and per-client mixture weights learned by "
            "federated EM; each client predicts with its mixture"
        ),
        docs="algorithms.md#fedem-fedem",
        fl_bench="FedEM",
    )
    Params = FedEMParams
    attackable = True
    server_optimizable = True  # server_opt steps on each component's average
    state_keys = ("components", "pi")

    def setup(self) -> None:
        M = self.hp.components
        rows = [self.engine.initial_state()]
        for m in range(1, M):  # independent initializations (see RECONSTRUCTION)
            seed = int(np.random.SeedSequence([self.run.seed, 2108, m]).generate_state(1)[0])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                rows.append(self.engine.spec.flatten(self.model_fn()).to(self.device))
        self.components = torch.stack(rows)  # [M, D]
        self.pi = torch.full((self.N, M), 1.0 / M, device=self.device)  # [N, M]

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def sample_losses(self, idx: torch.Tensor) -> torch.Tensor:
        """[M, n]: each component's cross-entropy on the samples at pool indices `idx`
        (evaluation mode, no augmentation)."""
        eng, bs = self.engine, self.engine.eval_batch_size
        out = torch.empty(len(self.components), int(idx.numel()), device=self.device)
        for s in range(0, int(idx.numel()), bs):
            x, y = self.fed.batch(idx[s : s + bs], train=False)
            for m, state in enumerate(self.components):
                out[m, s : s + bs] = F.cross_entropy(eng.logits(state, x), y, reduction="none")
        return out

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        M, frozen = self.hp.components, self.components
        log_pi = self.pi[idx].log()  # pi^{k-1}: the E-step's prior and the objective's
        pools = [self.fed.train_idx[int(i)] for i in clients]
        q = [e_step(log_pi[c], self.sample_losses(p)) for c, p in enumerate(pools)]  # E-step
        w = self.weights(clients, self.hp.weighting)
        share = 1.0  # the sampled clients' share of the weight over all N (`aggregate`)
        if self.hp.aggregate == "all":
            n = self.fed.train_sizes
            uniform = self.hp.weighting == "uniform"
            share = len(clients) / self.N if uniform else float(n[idx.cpu()].sum() / n.sum())
        new, loss = [], torch.zeros(len(clients), device=self.device)
        for m in range(M):
            obj = weighted_objective(self.engine.spec, frozen, log_pi, m)
            slot = f"component{m}"
            res = self.local_train(frozen[m], clients, t, objective=obj, salt=m, slot=slot)
            up = self.receive(res.states, clients, ref=frozen[m])
            avg = torch.lerp(frozen[m], w @ up, share)  # the unsampled hold frozen[m]
            new.append(self.server_step(f"component{m}", frozen[m], avg))
            loss += res.loss
        self.components = torch.stack(new)
        self.pi[idx] = torch.stack([qc.mean(0) for qc in q])  # M-step: pi^k
        n = len(clients) * M * self.engine.n_state
        return RoundReport(loss.mean(), self.comm(clients, up=n, down=n))

    # ------------------------------------------------------------------ deployed predictor
    @torch.no_grad()
    def mixture_probs(self, pi: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, K]: sum_m pi_m softmax(h_m(x)) (evaluation mode)."""
        return sum(
            p * torch.softmax(self.engine.logits(s, x), dim=-1) for p, s in zip(pi, self.components)
        )

    @torch.no_grad()
    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        out, bs = [], self.engine.eval_batch_size
        for s in range(0, int(idx.numel()), bs):
            x, y = self.fed.batch(idx[s : s + bs], train=False)
            out.append(self.mixture_probs(self.pi[i], x).argmax(-1) == y)
        if not out:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        return torch.cat(out)

    def personal_state(self, i: int) -> torch.Tensor:
        """[M * D + M]: what client i deploys, the M component states then pi_i (the layout
        of `personal_model`'s `Mixture` is its own: `personal_model` builds the module)."""
        return torch.cat([self.components.reshape(-1), self.pi[i]])

    def personal_model(self, i: int) -> nn.Module:
        comps = [self.engine.to_module(s, self.model_fn()) for s in self.components]
        return Mixture(comps, self.pi[i]).to(self.device)

    def model_size(self) -> dict[str, float]:
        """A client deploys the M components and its M weights pi."""
        M = self.hp.components
        return {"params_personal": M * self.engine.n_params + M}
