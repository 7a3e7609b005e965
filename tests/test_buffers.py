"""Buffers (BatchNorm running statistics) under every algorithm.

- Unit tests on a tiny BatchNorm MLP: the servers that mix models with signed coefficients
  (DiversiFed's z_i, FedAMP's u_i) mix parameters only and leave each client its own
  statistics; APPLE's personalized model keeps the statistics its training forwards update.
- Every registered algorithm on a BatchNorm model: two rounds on real FMNIST finish, every
  model the algorithm deploys has finite running statistics and no negative running variance,
  and the personalized models are above chance.

The model is the plain CNN with BatchNorm after each conv (channels 8-16, FC 32): 5 BatchNorm
buffers' worth of running statistics per model, a few seconds per algorithm on 2 CPU cores.
New algorithms are covered as soon as they are registered (`ALGORITHMS.names()`).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SMALL_FMNIST, TinyFed, bn_mlp, compose, fmnist_available
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.diversifed import mixing_matrix
from fedbench.algorithms.fedamp import attention_weights
from fedbench.config import load_config
from fedbench.engine import Engine


def bn_algo(name: str, extra=()):
    fed = TinyFed()
    cfg = compose([f"algo={name}", "batch_size=64", "optim.lr=0.1", *extra])
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    return ALGORITHMS.get(name).from_config(load_config(cfg), fed, eng, bn_mlp), eng, fed


def far_apart(states: torch.Tensor, n_params: int) -> None:
    """Clients' parameters at distances ~4-7 (client 2 the far one) and random statistics."""
    g = torch.Generator().manual_seed(3)
    states[:, :n_params] += 0.3 * torch.randn(states.shape[0], n_params, generator=g)
    states[2, :n_params] += 0.5
    D = states.shape[1]
    states[:, n_params:] = torch.rand(states.shape[0], D - n_params, generator=g)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["diversifed", "fedamp"])
def test_signed_server_mixtures_mix_parameters_and_keep_own_buffers(name):
    extra = ["algo.sigma=10.0", "algo.alpha_k=60.0"] if name == "fedamp" else []
    algo, eng, _ = bn_algo(name, extra)
    P = eng.n_params
    far_apart(algo.w, P)
    clients = torch.arange(3)
    if name == "diversifed":
        coef = mixing_matrix(algo.w[:, :P], algo.hp.alpha, algo.hp.tau)
    else:
        coef = attention_weights(algo.w[:, :P], algo.hp.alpha_k, algo.hp.sigma)
    # the client with the most negative coefficient gets large statistics: the same mix of
    # the statistics (the old code) is then negative
    j = int(coef.min(0).values.argmin())
    algo.w[j, P:] += 50.0
    mixed = algo.server_models(clients) if name == "diversifed" else algo.messages(clients)
    assert ((coef @ algo.w[:, P:].double()) < 0).any()
    torch.testing.assert_close(mixed[:, :P], (coef @ algo.w[:, :P].double()).float())
    torch.testing.assert_close(mixed[:, P:], algo.w[:, P:])


@pytest.mark.quick
def test_apple_personalized_model_keeps_the_statistics_its_training_updates():
    """Client 1's one batch (20 samples, batch 64): its running statistics are BatchNorm's
    update (momentum 0.1, unbiased variance) of the pre-norm activations of the mixture it
    trained, in its personalized model and in the core it uploads; the other cores' are
    untouched."""
    algo, eng, fed = bn_algo("apple")
    P = eng.n_params
    cores0, p0 = algo.cores.clone(), algo.p[1].clone()
    algo.round(0, [1])
    idx, lens = eng.schedule(1, 64, epochs=1, round=0)
    x, _ = fed.batch(idx[0, : lens[0]])
    model = eng.to_module(cores0[0], bn_mlp())  # cores0 rows are all the initial model
    mix = p0 @ cores0[:, :P]
    lin = model.body[0]
    W, b = mix[: lin.weight.numel()].view_as(lin.weight), mix[lin.weight.numel() :][:8]
    h = x @ W.T + b
    mean = 0.1 * h.mean(0)
    var = 0.9 * 1.0 + 0.1 * h.var(0, unbiased=True)
    buffers = dict(eng.to_module(algo.theta[1], bn_mlp()).named_buffers())
    torch.testing.assert_close(buffers["body.1.running_mean"], mean)
    torch.testing.assert_close(buffers["body.1.running_var"], var)
    torch.testing.assert_close(algo.cores[1, P:], algo.theta[1, P:])
    torch.testing.assert_close(algo.cores[[0, 2]], cores0[[0, 2]])


BN_CNN = [
    "model=cnn",
    "model.preset=null",
    "model.channels=[8,16]",
    "model.fc=[32]",
    "model.norm=batch",
    "clients=10",
    "optim.name=adam",
    "optim.lr=1e-3",
    "local_epochs=2",
    # the evaluation is what the check reads (L), on half the test samples: it cost as much
    # as the training with S sets and 100 samples a client
    "split.test_per_client=50",
    "eval.s_frac=0",
]

# pat-2 (two classes per client), 12 Adam steps per client in all: chance is 0.1 over the 10
# classes. Sane statistics put every personalized model above twice that (measured: 0.31 to
# 0.97 over the algorithms that pass); NaN statistics score 0.1 (argmax of NaN logits), and
# statistics never updated (APPLE's old (0, 1)) are caught by `check_buffers`.
ABOVE_CHANCE = 0.2


def _bn_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}


def check_buffers(model: torch.nn.Module, who: str) -> None:
    bufs = _bn_buffers(model)
    assert bufs, f"{who}: the model has no BatchNorm buffers"
    for name, b in bufs.items():
        assert torch.isfinite(b).all(), f"{who}: {name} is not finite"
        if name.endswith("running_var"):
            assert (b >= 0).all(), f"{who}: {name} has negative entries (min {b.min():.3g})"
    means = [b for n, b in bufs.items() if n.endswith("running_mean")]
    assert any(bool((m != 0).any()) for m in means), f"{who}: statistics never updated"


def run_bn(tmp_path, algo: str, extra=(), rounds: int = 2):
    """conftest.run_small with the MLP replaced by the BatchNorm CNN (run_small's list sets
    `model.hidden`, which the CNN does not have)."""
    from fedbench.runner import Run

    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed (apt-get install dataset-fashion-mnist)")
    base = [o for o in SMALL_FMNIST if not o.startswith("model")]
    cfg = compose([*base, f"rounds={rounds}", f"algo={algo}", *BN_CNN, *extra])
    run = Run(cfg, tmp_path, progress=False)
    return run.run(), run


# Per-algorithm budgets where the common one cannot learn. FedPG and S-FedPG take one server
# step of size lr per round along the normalized min-norm direction (the paper's method, full
# gradients): Adam's 1e-3 for 2 rounds leaves them at chance (0.098). They get plain SGD at
# the FedPG presets' lr grid top (0.1, conf/experiment/fedpg_common.yaml sweeps 0.01-0.1)
# and 10 rounds (measured L-acc. 0.81 / 0.89); the threshold stays ABOVE_CHANCE.
BUDGETS: dict[str, tuple[list[str], int]] = {
    "fedpg": (["optim.name=sgd", "optim.lr=0.1"], 10),
    "sfedpg": (["optim.name=sgd", "optim.lr=0.1"], 10),
    # SCAFFOLD's option II control variates are defined for SGD steps (Adam is refused).
    "scaffold": (["optim.name=sgd", "optim.lr=0.05"], 2),
    # pFedLA's code default hn_lr 5e-3 leaves the mixing near uniform for many rounds (a
    # global model of every stored client model: 0.203 after 2 rounds, at the bar); the
    # hypernetwork personalizes the mix from hn_lr ~10 on (0.296)
    "pfedla": (["algo.hn_lr=10.0"], 2),
    # GPFL's extra modules learn slowly at Adam 1e-3 (0.144 after 2 rounds, 0.617 after 4)
    "gpfl": (["optim.name=sgd", "optim.lr=0.05"], 2),
    # FedCP's MMD term (lambda 5, fixed RBF bandwidths) holds the extractor near the last
    # global one: 0.121 after 2 rounds; without it (lam 0) 0.355
    "fedcp": (["algo.lam=0"], 2),
    # pFedMe's R = 20 mini-batches x K = 5 inner steps per visit is 200 gradient steps per
    # client in 2 rounds (the others take 12): local_epochs passes instead (PFLlib's pFedMe,
    # 30 per round) learn as well (measured 0.876)
    "pfedme": (["algo.local_rounds=null"], 2),
}


# The README's test command runs six algorithms of different kinds (one model, BatchNorm
# kept local, two models, a frozen body, a step-function loop, a custom objective); the
# other algorithms (3 s to 15 s each, 2 minutes in all) run with the `long` tests (CI's half 2).
DEFAULT_BN = ("fedavg", "fedbn", "ditto", "fedrep", "apple", "moon")


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo",
    [a if a in DEFAULT_BN else pytest.param(a, marks=pytest.mark.long) for a in ALGORITHMS.names()],
)
def test_batchnorm_statistics_stay_sane(tmp_path, algo):
    extra, rounds = BUDGETS.get(algo, ([], 2))
    s, run = run_bn(tmp_path, algo, extra, rounds)
    a = run.algo
    if a.has_personal:
        for i in range(a.N):  # one model at a time (personal_state(i) inside)
            check_buffers(a.personal_model(i), f"{algo} client {i}")
    g = a.global_model() if a.has_global else None
    if g is not None:
        check_buffers(g, f"{algo} global model")
    kind = "personal" if s["final"].get("personal") else "global"
    acc = s["final"][kind]["L"]["avg"]
    print(f"ACC {algo} {acc:.3f}")
    assert not math.isnan(acc) and acc > ABOVE_CHANCE, f"{algo}: {kind} accuracy {acc}"
