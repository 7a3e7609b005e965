"""Small pieces shared by several algorithm modules (not an algorithm module: the leading
underscore keeps it out of the registry scan).

- `state_entries`: a [D] boolean over a state's entries from a [P] mask over its parameters
  (the head of FedRep, LG-FedAvg and SplitGP, FedRoD's shared part).
- `dynamic_clients` / `dynamic_server`: FedDyn's client step and server mean (Acar et al.,
  Algorithm 1), which FedDyn and FedSLR's Phase I both call in their own `round`.
- `pairwise_sq_dists`: all squared distances between flattened models from one Gram matrix
  (DiversiFed, FedAMP); O(N^2 P) in one matmul instead of a double loop.
- `mix_parameters`: a server's combination of clients' models with the paper's (possibly
  signed) coefficients, on the parameters only; buffers (BatchNorm running statistics)
  come from a given row, never from a signed combination (a negative variance otherwise).
- `class_means` / `feature_moments`: per-class mean features over index sets (FedProto's
  prototypes, FedPAC's centroids), with the sum of squared feature norms (FedPAC's V_i);
  `aggregate_prototypes`: the server's per-class mean of the clients' class means (FedProto,
  FedPAC, FedGH).
- `base_columns`: where the run model's entries sit in the flat state of a module that
  contains it (APFL's two copies, FedCP's and SplitGP's wrapped models).
- `keyed_generator`: a torch generator seeded by a key (run seed, round, client, a salt of
  your own): random draws that need no saved state, so a resumed run draws what an
  uninterrupted one does (the engine's batch schedule is keyed the same way).
- `entry_index`: the flat-state indices of named parameters/buffers (an algorithm's own
  module trained on a second engine: FedDBE's PRBM, GPFL's CoV and GCE).
- `TrainSubset` / `make_engine` / `train_on` / `WithTrainer`: a second engine over a
  held-out split or another module (FedFomo's validation split, FedRoD's two-head model),
  with the run's engine settings, `Algorithm.local_train`'s defaults, and its optimizer
  state in the algorithm's checkpoint; `TrainerLayout` for algorithms that deploy rows of
  that engine's module.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedbench.engine import Engine, TrainResult
from fedbench.engine.spec import ModelSpec
from fedbench.engine.terms import dynamic


def state_entries(param_mask: torch.Tensor, n_state: int, *, buffers: bool = False) -> torch.Tensor:
    """[D] bool over a state's entries (parameters, then buffers: `engine.spec`) from a [P]
    bool `param_mask` over its parameters; the buffer entries are `buffers`. On the mask's
    device."""
    out = torch.full((n_state,), buffers, dtype=torch.bool, device=param_mask.device)
    out[: param_mask.numel()] = param_mask
    return out


# ---------------------------------------------------------------------- FedDyn's Phase I
def dynamic_clients(
    algo, theta: torch.Tensor, lam: torch.Tensor, clients, t: int, alpha: float
) -> tuple[TrainResult, torch.Tensor]:
    """The sampled clients of FedDyn (Acar et al. Algorithm 1, lines 6-7; FedSLR's Phase I,
    its Algorithm 1 lines 4-9): from theta^t [D], `Algorithm.local_train` (the run's
    epochs and optimizer, its weight decay included) on
        f_i(x) - <lam_i, x> + (alpha / 2) ||x - theta^t||^2      (`terms.dynamic`),
    then lam_i <- lam_i - alpha (x_i - theta^t) on the parameters.
    `lam`: the clients' lam_i [C, P]. Returns (the training result, whose states are the
    x_i [C, D] the clients upload; the new lam_i [C, P])."""
    res = algo.local_train(theta, clients, t, terms=dynamic(lam, theta, alpha))
    P = lam.shape[1]
    return res, lam - alpha * (res.states[:, :P] - theta[:P])


def dynamic_server(
    x: torch.Tensor, theta: torch.Tensor, h: torch.Tensor, alpha: float, n_clients: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedDyn's memory-efficient server (Acar et al. Algorithm 1, lines 9-10; FedSLR
    Algorithm 3) on the uploads x [C, D] from theta^t [D], with only h = (1/N) sum_i lam_i
    [P] kept: (h - (alpha / N) sum_i (x_i - theta^t), z = mean_i x_i - h_new / alpha), the
    correction on the parameters only (buffers: the plain mean)."""
    P = h.numel()
    h = h - (alpha / n_clients) * (x[:, :P] - theta[:P]).sum(0)
    z = x.mean(0)
    z[:P] -= h / alpha
    return h, z


def pairwise_sq_dists(w: torch.Tensor, rel_tol: float = 1e-8, chunk: int = 1 << 20) -> torch.Tensor:
    """[N, N] float64 squared Euclidean distances between the rows of w [N, P].

    One Gram matrix of the centred rows (a common shift leaves distances unchanged and
    removes most of the cancellation in ||a||^2 + ||b||^2 - 2 a.b), accumulated in float64
    over column chunks of `chunk` parameters. Entries at or below `rel_tol` times
    ||a_c||^2 + ||b_c||^2 are rounding of identical rows and set to 0 (and the diagonal), so
    identical models are exactly at distance 0.
    """
    wc = w - w.mean(0, keepdim=True)
    n = w.shape[0]
    gram = torch.zeros(n, n, dtype=torch.float64, device=w.device)
    for s in range(0, w.shape[1], chunk):
        part = wc[:, s : s + chunk].double()
        gram += part @ part.T
    sq = gram.diagonal()
    scale = sq[:, None] + sq[None, :]
    d2 = (scale - 2 * gram).clamp_min(0)
    d2 = torch.where(d2 <= rel_tol * scale, torch.zeros_like(d2), d2)
    return d2.fill_diagonal_(0)


def mix_parameters(
    coef: torch.Tensor, states: torch.Tensor, own: torch.Tensor, n_params: int
) -> torch.Tensor:
    """[C, D]: `coef` [C, N] @ the parameter part of `states` [N, D], with the buffers of
    `own` [C, D] (each receiver's own running statistics).

    The coefficients of DiversiFed's and FedAMP's server steps are signed (a far model
    repels, a self-weight 1 - sum_j xi_ij can be below 0). Their papers mix parameters
    (the distances, the gradient of L_d, the attention function are over parameters, whose
    gradient with respect to a running statistic is 0); a running variance mixed with such
    coefficients can go negative and the next forward is NaN. So buffers are not mixed: each
    row keeps the buffers of `own`."""
    out = own.clone()
    out[:, :n_params] = coef.to(states.dtype) @ states[:, :n_params]
    return out


@torch.no_grad()
@torch.no_grad()
def feature_moments(
    engine: Engine, state: torch.Tensor, idx: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over pool indices `idx` (eval mode, no augmentation): the class means of
    `model.features(x)` ([K, F], zero where absent), the class counts [K] and
    sum_l ||f(x_l)||^2 (0-d; FedPAC's feature variance)."""
    engine.load(state)
    model = engine.model
    model.eval()
    sums = torch.zeros(num_classes, model.feature_dim, device=engine.device)
    counts = torch.zeros(num_classes, device=engine.device)
    sq = torch.zeros((), device=engine.device)
    bs = engine.eval_batch_size
    for s in range(0, int(idx.numel()), bs):
        x, y = engine.fed.batch(idx[s : s + bs], train=False)
        f = model.features(x)
        sums.index_add_(0, y, f)
        counts += torch.bincount(y, minlength=num_classes)
        sq += (f * f).sum()
    return sums / counts.clamp_min(1)[:, None], counts, sq


def class_means(
    engine: Engine, state: torch.Tensor, idx: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of `model.features(x)` per class over pool indices `idx` (no augmentation, eval
    mode): ([K, F] means, zero where absent; [K] sample counts)."""
    means, counts, _ = feature_moments(engine, state, idx, num_classes)
    return means, counts


def aggregate_prototypes(
    local: torch.Tensor, counts: torch.Tensor, weighting: str = "uniform"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global prototypes from local ones [C, K, F] and class counts [C, K]: per class, the
    mean over the clients that hold it (uniform, or weighted by counts); ([K, F], [K] bool
    "class has a prototype")."""
    has = counts > 0
    w = has.to(local.dtype) if weighting == "uniform" else counts.to(local.dtype)
    total = w.sum(0)
    protos = (w[:, :, None] * local).sum(0) / total.clamp_min(1e-12)[:, None]
    return protos, total > 0


def base_columns(sub, base, prefix: str, device=None) -> torch.Tensor:
    """[D_base] positions in a state of layout `sub` (ModelSpec) of the entries of layout
    `base` named `prefix + name` (parameters, then buffers, in base's order)."""
    cols = []
    for e in base.params + base.buffers:
        s = sub.index[prefix + e.name]
        cols.append(torch.arange(s.start, s.stop))
    return torch.cat(cols).to(device)


def argmin_lowest(values: torch.Tensor, rel_tol: float = 1e-6) -> torch.Tensor:
    """argmin over the last dimension, a near-tie going to the lowest index ([...]).

    Values within `rel_tol` of the row's minimum count as tied: the same model evaluated twice
    in one batched call can differ in its last bits on a GPU (its kernels sum in other orders
    than the CPU's), and a tie rule must not depend on those bits."""
    m = values.min(-1, keepdim=True).values
    near = values <= m + rel_tol * m.abs()
    idx = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    return torch.where(near, idx, values.shape[-1]).min(-1).values


def first_k_mask(values: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """Bool mask of the first k entries of each row's stable sort (descending with
    `largest`): the k largest (smallest) of each row of values [..., n], ties to the lowest
    index. A selection, not a sort: the row's k-th value t (`kthvalue`, exact whatever the
    kernel's tie order), every entry better than t, and the entries equal to t from the
    lowest index until there are k. Values without NaN; 0 <= k <= n."""
    n = values.shape[-1]
    if k <= 0:
        return torch.zeros_like(values, dtype=torch.bool)
    t = torch.kthvalue(values, n - k + 1 if largest else k, dim=-1, keepdim=True).values
    better = values > t if largest else values < t
    tied = values == t
    room = k - better.sum(-1, keepdim=True)
    return better | (tied & (tied.cumsum(-1) <= room))


def topk_lowest_index(values: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """Indices of the k largest (smallest) entries of a 1-D tensor, ties to the lowest index.

    `torch.topk` leaves the order of tied entries to the kernel: the CPU and CUDA pick
    different entries among equal values, so a selection over exact ties (gradients of 0)
    would make a GPU run differ from a CPU run by a whole choice. The answer is the first k
    of a stable sort (values without NaN), found by `first_k_mask` and then only those k
    sorted (stably: equal values are in index order)."""
    k = min(int(k), values.numel())
    chosen = first_k_mask(values, k, largest).nonzero()[:, 0]
    return chosen[torch.sort(values[chosen], descending=largest, stable=True).indices]


def keyed_generator(*key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from `key` alone (`keyed_generator(seed, t, i, SALT)`): the same
    key draws the same numbers in any run, on resume too, with nothing to checkpoint. Give
    every purpose its own constant salt, so two purposes never draw the same stream."""
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(seed)


def entry_index(spec: ModelSpec, names: Sequence[str], device: torch.device | str) -> torch.Tensor:
    """[n] long indices into `spec`'s flat state of the named parameters/buffers, in the
    order of `names` (each name's entries in its own flattening order)."""
    parts = [torch.arange(spec.index[n].start, spec.index[n].stop) for n in names]
    return torch.cat(parts).to(device)


class TrainSubset:
    """The federation with every client's training indices replaced (all else shared)."""

    def __init__(self, fed, train_idx: list[torch.Tensor]) -> None:
        self._fed = fed
        self.train_idx = train_idx
        self.train_sizes = torch.tensor([float(len(i)) for i in train_idx])

    def __getattr__(self, name: str):
        return getattr(self._fed, name)


def make_engine(algo, model: nn.Module, fed=None) -> Engine:
    """An engine like the run's (seed, backend, device, batching, vmap chunking and memory
    budget) over `model` and `fed`."""
    e = algo.engine
    return Engine(
        algo.fed if fed is None else fed,
        model,
        device=e.device,
        seed=e.seed,
        backend=e.backend,
        drop_last=e.drop_last,
        eval_batch_size=e.eval_batch_size,
        chunk_clients=e.chunk_clients,
        memory_budget=e.memory_budget,
        rows=e.rows_policy,
    )


def train_on(algo, engine: Engine, states: torch.Tensor, clients, t: int, **kw):
    """`Algorithm.local_train` (the run's epochs, batch size, optimizer, lr at round t) on
    another engine."""
    kw.setdefault("epochs", None if "steps" in kw else algo.run.local_epochs)
    kw.setdefault("batch_size", algo.run.batch_size)
    kw.setdefault("lr", algo.optim.lr_at(t))
    return engine.train(states, clients, optim=algo.optim, round=t, **kw)


class WithTrainer:
    """Mixin for an algorithm whose clients train on a second engine `self.trainer`: that
    engine's kept optimizer state (`optim.persist_state`) goes into the checkpoint."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), "trainer": self.trainer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.trainer.load_state_dict(state["trainer"])


class TrainerLayout(WithTrainer):
    """Mixin for an algorithm whose deployed states are rows of its second engine's module
    (FedRoD's two heads, FedCP's policy network, FedDBE's PRBM, GPFL's CoV): evaluation and
    `personal_model` go through `self.trainer`; `trainer_module()` builds that module anew."""

    def trainer_module(self) -> nn.Module:
        raise NotImplementedError

    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        return self.trainer.correct(self.personal_state(i), idx)

    def personal_model(self, i: int) -> nn.Module:
        return self.trainer.to_module(self.personal_state(i), self.trainer_module().to(self.device))
