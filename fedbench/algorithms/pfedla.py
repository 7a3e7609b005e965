"""pFedLA (Ma, Zhang, Guo, Xu: "Layer-wised Model Aggregation for Personalized Federated
Learning", CVPR 2022, arXiv:2205.03993; the code of KarhouTam/pFedLA, a reproduction (its
README says it is not the authors' official code), and FL-bench src/server/pfedla.py).

The server keeps every client's model theta_j [N, D] and, per client i, a dedicated
hypernetwork HN_i(v_i; psi_i) (the paper's Figure 2) that outputs client i's layer-wise
aggregation weight matrix alpha_i [L, N] over the L layers and the N clients:

    h_i = MLP_i(v_i)            Linear(E, H), ReLU, Linear(H, H), ReLU, Linear(H, H), ReLU
    a_i^l = ReLU(W_i^l h_i + b_i^l) in R^N,   alpha_i^{l,j} = a_i^{l,j} / sum_k a_i^{l,k}
    theta_bar_i^l = sum_j alpha_i^{l,j} theta_j^l                    (layer-wise aggregation)

Round t, each sampled client i (Figure 2's steps): the server sends theta_bar_i (4, 5); the
client trains it E epochs of the run's optimizer to theta~_i and uploads it (1, 2); the
server updates HN_i by the chain rule, as pFedHN (3):

    Delta_i = theta_bar_i - theta~_i                                  (parameter entries)
    g_i = (d theta_bar_i / d psi_i)^T Delta_i = grad_psi_i <theta_bar_i(psi_i), Delta_i>
    psi_i <- psi_i - eta g_i     (psi_i = v_i, MLP_i, W_i, b_i: SGD, lr `hn_lr`)
    theta_i <- theta~_i          (the server stores the client's trained model)

the other clients' theta_j held constant. Since theta_bar_i is linear in alpha_i,
<theta_bar_i, Delta_i> = sum_{l,j} alpha_i^{l,j} M_i[l, j] with M_i[l, j] = <theta_j^l,
Delta_i^l>: the VJP is one pass over the N stored models ([L, N] inner products) and a
backward through the small hypernetwork, never through an [N, D] graph.
The personalized model of client i is theta_bar_i (Figure 2's step 4, "personalized model
theta_bar_i"; what the server would send next, which the reproduction's test evaluates); it
is built for that client alone.

HeurpFedLA (`k` > 0, the paper's heuristic variant): the k layers with the largest self
weight alpha_i^{l,i} take client i's own theta_i^l (one-hot weights), are not downloaded
(the client holds them) and give HN_i no gradient (the reproduction's `retain_blocks`).

RECONSTRUCTION (the paper's text beyond its abstract and Figure 2 was not available here;
the rest follows KarhouTam/pFedLA, where it and FL-bench agree, else as stated):
- the hypernetwork: E = H = 100, a 3-layer ReLU MLP, one Linear(H, N) head per layer with
  U(0, 1) weights and zero bias (so the first alpha are positive), ReLU, normalised by their
  sum; a layer whose a_i^l is all zero falls back to one-hot own weights (FL-bench; the
  reproduction raises); v_i ~ N(0, 1) (nn.Embedding); SGD lr 5e-3, momentum 0 (FL-bench's
  `hn_momentum`, whose one optimizer shares a momentum buffer across all clients'
  hypernetworks; here one buffer per client); each client's hypernetwork initialised
  independently (the reproduction; FL-bench copies one initialisation to every client);
- `delta`: the sign of Delta_i. `sent_minus_trained` (default) descends: to first order the
  step moves theta_bar_i(psi_i) toward theta~_i (pFedHN's code, delta = inner - final).
  KarhouTam/pFedLA steps psi_i -= eta J^T (theta~_i - theta_bar_i) (autograd.grad with
  grad_outputs = the client's trained-minus-sent diff, then param -= hn_lr * grad), the
  opposite direction: `trained_minus_sent` reproduces it. (Whether the paper's own update
  equation carries this sign could not be checked here.) FL-bench has the same sign
  (grad_outputs = -(sent - trained), SGD step), but there theta_bar_i never reaches a model:
  FedAvgClient.set_parameters loads personal_model_params, pFedLA's full stored theta_i,
  over regular_model_params = theta_bar_i, so its clients train and are evaluated from their
  own theta_i and its Delta is taken against theta_i;
- a layer (`granularity: layer`) is one unit of `model.layers()` (a Conv/Linear with its
  norm), as the reproduction's top-level blocks (conv + BN); FL-bench gives every parameter
  tensor its own head (`granularity: tensor`);
- synchronous rounds: every sampled client's theta_bar_i is mixed from the models stored at
  the round's start (the reproduction and FL-bench visit the clients one after another, a
  client mixing the models the earlier ones of the round just stored);
- every client starts from the same initial model (FL-bench; the reproduction draws an
  independent initialisation per client);
- HeurpFedLA ranks layers by the normalised self weight alpha_i^{l,i} (the reproduction by
  the unnormalised a_i^{l,i}).
Uploads: client i's trained state theta~_i (kind "model", ref = theta_bar_i); the server
stores it and takes Delta_i from it. Communication: D up, D (minus the retained layers) down.
Buffers: the client's own: theta_bar_i mixes parameters only and keeps theta_i's running
statistics (the reproduction's one-hot weight for non-trainable entries), which its
training updates and the server stores with theta~_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp, positive
from fedbench.engine import ModelSpec, OptimConfig
from fedbench.engine.optim import step_
from fedbench.errors import ConfigError


@dataclass
class PFedLAParams:
    hn_lr: float = positive()  # eta: SGD learning rate of each client's hypernetwork
    hn_momentum: float = hp(ge=0, lt=1)  # its SGD momentum (one buffer per client)
    embed_dim: int = hp(ge=1)  # E: size of the client embedding v_i
    hidden: int = hp(ge=1)  # H: width of the hypernetwork's MLP
    k: int = hp(ge=0)  # HeurpFedLA: layers kept local per round (0: pFedLA)
    granularity: Literal["layer", "tensor"]  # one weight row per model.layers() unit | tensor
    delta: Literal["sent_minus_trained", "trained_minus_sent"]  # Delta_i's sign (see docstring)
    max_params: float = positive()  # refuse N hypernetworks larger than this in all


class LayerWeightNet(nn.Module):
    """HN_i(v_i; psi_i) -> a_i [L, N] >= 0 (before normalisation): client i's hypernetwork,
    its embedding v_i included (a parameter of its own, as each client has its own)."""

    def __init__(self, n_clients: int, n_layers: int, embed_dim: int, hidden: int) -> None:
        super().__init__()
        self.shape = (n_layers, n_clients)
        self.embedding = nn.Parameter(torch.randn(embed_dim))  # nn.Embedding's N(0, 1)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        # the L heads Linear(H, N) stacked in one Linear(H, L N); U(0, 1) weights and zero
        # bias, so that the ReLU'd outputs start positive (the reproduction's comment)
        self.heads = nn.Linear(hidden, n_layers * n_clients)
        nn.init.uniform_(self.heads.weight)
        nn.init.zeros_(self.heads.bias)

    def forward(self) -> torch.Tensor:
        return torch.relu(self.heads(self.mlp(self.embedding))).view(self.shape)


def hypernet_numel(n_clients: int, n_layers: int, embed_dim: int, hidden: int) -> int:
    """Parameters of one `LayerWeightNet`."""
    mlp = embed_dim * hidden + hidden + 2 * (hidden * hidden + hidden)
    return embed_dim + mlp + (hidden + 1) * n_layers * n_clients


@ALGORITHMS.register()
class PFedLA(Algorithm):
    about = About(
        name="pFedLA",
        paper="Ma, Zhang, Guo, Xu, CVPR 2022",
        summary=(
            "per-client hypernetworks output layer-wise aggregation weights over all "
            "clients' stored models, trained by the chain rule on the clients' updates;"
            " HeurpFedLA (`algo.k`) keeps the top-k self-weighted layers local"
        ),
        docs="algorithms.md#pfedla-pfedla",
        fl_bench="pFedLA",
    )
    Params = PFedLAParams
    attackable = True
    state_keys = ("theta", "psi", "psi_buf")

    def setup(self) -> None:
        spec, dev = self.engine.spec, self.device
        if self.hp.granularity == "layer":
            groups = [list(layer.params) for layer in self.engine.model.layers()]
        else:
            groups = [[e.name] for e in spec.params]
        self.n_layers = len(groups)
        if self.hp.k > self.n_layers:
            n, unit = self.n_layers, self.hp.granularity
            raise ConfigError(f"algo.k={self.hp.k}: the model has {n} {unit}s; use 0..{n}")
        # (layer, slice of the flat state) for every parameter tensor
        self.pieces = [
            (g, slice(spec.index[n].start, spec.index[n].stop))
            for g, names in enumerate(groups)
            for n in names
        ]
        self.layer_numel = torch.zeros(self.n_layers, dtype=torch.long)
        for g, s in self.pieces:
            self.layer_numel[g] += s.stop - s.start

        E, H = self.hp.embed_dim, self.hp.hidden
        size = self.N * hypernet_numel(self.N, self.n_layers, E, H)
        if size > self.hp.max_params:
            raise ConfigError(
                f"pFedLA's {self.N} hypernetworks ({self.n_layers} {self.hp.granularity}s, "
                f"embed_dim={E}, hidden={H}) have {size / 1e6:.1f}M parameters, over "
                f"algo.max_params={self.hp.max_params / 1e6:.1f}M; lower algo.hidden or "
                "algo.embed_dim, use algo.granularity=layer, or raise algo.max_params"
            )
        with torch.random.fork_rng(devices=[]):  # its own draws, seeded by the run
            torch.manual_seed(self.run.seed)
            nets = [LayerWeightNet(self.N, self.n_layers, E, H) for _ in range(self.N)]
        self.hspec = ModelSpec(nets[0])  # the layout psi's rows follow
        # every row flattened on the CPU, where the nets were built, then moved: `.to` moves
        # nets[0] itself, and a stack of one device row with CPU rows fails on a GPU
        self.psi = torch.stack([self.hspec.flatten(n) for n in nets]).to(dev)  # [N, Hn]
        self.hnet = nets[0].to(dev)
        self.hn_optim = OptimConfig(name="sgd", lr=self.hp.hn_lr, momentum=self.hp.hn_momentum)
        # per-client momentum; empty without (a tensor of its own: a view would checkpoint psi)
        self.psi_buf = torch.zeros(self.psi.shape if self.hp.hn_momentum else 0, device=dev)
        self.theta = self.engine.initial_state().repeat(self.N, 1)  # [N, D]: the stored models

    # ------------------------------------------------------------------ the hypernetworks
    def raw_weights(self, i: int, psi: torch.Tensor | None = None) -> torch.Tensor:
        """a_i [L, N] = HN_i(v_i; psi_i), differentiable in `psi` (default: the stored row)."""
        psi = self.psi[i] if psi is None else psi
        return torch.func.functional_call(self.hnet, self.hspec.param_views(psi), ())

    def alpha(self, i: int, psi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha_i [L, N], each row summing to 1; kept [L] bool): the layers HeurpFedLA keeps
        local, and any layer whose a_i^l is all zero, take one-hot own weights."""
        a = self.raw_weights(i, psi)
        s = a.sum(-1, keepdim=True)
        dead = s.squeeze(-1) == 0
        own = torch.zeros_like(a)
        own[:, i] = 1.0
        w = torch.where(dead[:, None], own, a / torch.where(dead[:, None], 1.0, s))
        kept = torch.zeros(self.n_layers, dtype=torch.bool, device=a.device)
        if self.hp.k:
            kept[torch.topk(w[:, i].detach(), self.hp.k).indices] = True
            w = torch.where(kept[:, None], own, w)
        return w, kept | dead

    def mix(self, w: torch.Tensor, own: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """theta_bar [D] = layer by layer sum_j w[l, j] theta_j^l, with `own`'s buffers."""
        out = own.clone()
        for g, s in self.pieces:
            out[s] = w[g] @ theta[:, s]
        return out

    def hypernet_grad(
        self, i: int, delta: torch.Tensor, theta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g_i = grad_psi_i <theta_bar_i(psi_i), delta> [Hn], alpha_i): the stored models
        `theta` [N, D] constant; delta [P] over the parameters."""
        M = torch.zeros(self.n_layers, self.N, device=self.device)
        for g, s in self.pieces:  # M[l, j] = <theta_j^l, delta^l>
            M[g] += theta[:, s] @ delta[s]
        psi = self.psi[i].detach().requires_grad_(True)
        w, fixed = self.alpha(i, psi)
        # a one-hot (kept or dead) layer is constant: no gradient, as the reproduction
        objective = (w * M).masked_fill(fixed[:, None], 0.0).sum()
        (g,) = torch.autograd.grad(objective, psi, allow_unused=False)
        return g, w.detach()

    # ------------------------------------------------------------------ the contract
    @torch.no_grad()
    def sent(self, clients) -> tuple[torch.Tensor, torch.Tensor]:
        """(theta_bar [C, D] for `clients`, kept [C, L]) from the models stored now."""
        rows, kept = [], []
        for i in clients:
            w, fixed = self.alpha(int(i))
            rows.append(self.mix(w, self.theta[int(i)], self.theta))
            kept.append(fixed)
        return torch.stack(rows), torch.stack(kept)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        start, kept = self.sent(clients)
        res = self.local_train(start, clients, t)
        got = self.receive(res.states, clients, ref=start)
        P = self.engine.n_params
        delta = start[:, :P] - got[:, :P]
        if self.hp.delta == "trained_minus_sent":
            delta = -delta
        grads, selfw = [], []
        for c, i in enumerate(clients):  # every delta against the round's stored models
            g, w = self.hypernet_grad(int(i), delta[c], self.theta)
            grads.append(g)
            selfw.append(w[:, int(i)].mean())
        psi = self.psi[idx]
        st = {"buf": self.psi_buf[idx]} if self.hp.hn_momentum else {}
        step_(self.hn_optim, psi, torch.stack(grads), st, self.hp.hn_lr, consume_grad=True)
        self.psi[idx] = psi
        if st:
            self.psi_buf[idx] = st["buf"]
        self.theta[idx] = got
        # a layer with one-hot own weights (HeurpFedLA's kept ones) is the client's own
        # theta~_i^l, which it holds: not sent down
        own_numel = int((kept.cpu().long() * self.layer_numel).sum())
        c, D = len(clients), self.engine.n_state
        comm = self.comm(clients, up=c * D, down=c * D - own_numel)
        return RoundReport(res.loss.mean(), comm, {"alpha_self": torch.stack(selfw).mean()})

    @torch.no_grad()
    def personal_state(self, i: int) -> torch.Tensor:
        w, _ = self.alpha(i)
        return self.mix(w, self.theta[i], self.theta)

    def personal_states(self) -> torch.Tensor:
        return torch.stack([self.personal_state(i) for i in range(self.N)])
