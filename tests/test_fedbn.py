"""FedBN: which entries each client keeps (the BatchNorm layers' parameters and statistics),
one round against the engine by hand, the GroupNorm rule, that it learns on real FMNIST with
a BatchNorm CNN, and that a killed run resumes exactly. (The vmap backend does not train
models with BatchNorm statistics: the sequential backend is the one that applies.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SMALL_FMNIST_BN_CNN, TinyFed, compose, crash_and_resume, run_small
from fedbench.config import load_config


def cnn_algo(norm: str, *over: str, plain_norm1: bool = False):
    """FedBN on a CNN [conv-norm]x2-fc on TinyFed's features as 6x6 images; `plain_norm1`:
    the first norm a BatchNorm without affine parameters."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed()
    fed.x = fed.x.reshape(-1, 1, 1, 6).expand(-1, 1, 6, 6).contiguous()
    fed.input_shape = (1, 6, 6)
    opts = dict(preset=None, channels=[4, 4], fc=[8], kernel=3, padding=1, norm=norm)

    def model_fn():
        model = build_model("cnn", fed.input_shape, fed.num_classes, **opts)
        if plain_norm1:
            model.body.norm1 = torch.nn.BatchNorm2d(4, affine=False)
        return model

    torch.manual_seed(0)
    eng = Engine(fed, model_fn(), device="cpu")
    cfg = compose(["algo=fedbn", "batch_size=8", "optim.lr=0.1", *over])
    return ALGORITHMS.get("fedbn").from_config(load_config(cfg), fed, eng, model_fn), eng, fed


def norm_modules(eng, kinds) -> set[str]:
    return {n for n, m in eng.model.named_modules() if isinstance(m, kinds)}


@pytest.mark.quick
def test_the_batchnorm_layers_and_their_statistics_stay_local():
    algo, eng, _ = cnn_algo("batch")
    bns = norm_modules(eng, torch.nn.BatchNorm2d)
    assert len(bns) == 2
    own = algo.personal_entries
    for e in eng.spec.params + eng.spec.buffers:
        assert bool(own[e.start : e.stop].all()) == (e.name.rsplit(".", 1)[0] in bns), e.name
        assert bool(own[e.start : e.stop].any()) == bool(own[e.start : e.stop].all())
    assert any(e.name.endswith("running_var") for e in eng.spec.buffers)


@pytest.mark.quick
def test_a_batchnorm_without_affine_parameters_keeps_its_statistics_local():
    """Such a BatchNorm owns no parameter, so FedPer's rule (a personal parameter's module
    keeps its buffers) would average its running statistics."""
    algo, eng, _ = cnn_algo("batch", plain_norm1=True)
    own = algo.personal_entries
    names = {e.name for e in eng.spec.params + eng.spec.buffers if own[e.start : e.stop].all()}
    assert names == {
        "body.norm1.running_mean",
        "body.norm1.running_var",
        "body.norm2.weight",
        "body.norm2.bias",
        "body.norm2.running_mean",
        "body.norm2.running_var",
    }
    assert algo.personal.shape == (algo.N, int(own.sum()))
    before = algo.personal.clone()
    algo.round(0, np.array([0, 2]))
    assert torch.equal(algo.personal[1], before[1])  # client 1's statistics untouched
    assert not torch.equal(algo.personal[0], algo.personal[2])  # each its own


@pytest.mark.quick
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_round_by_hand(weighting):
    """Sampled clients train (W^t, own BN) E epochs; the server averages everything but the
    BN entries; each keeps its trained BN layers (statistics included); the others keep
    theirs; a client deploys the new W with its own BN."""
    algo, eng, fed = cnn_algo("batch", f"algo.weighting={weighting}")
    own = algo.personal_entries
    g = torch.Generator().manual_seed(1)
    algo.personal = algo.personal + 0.1 * torch.randn(algo.personal.shape, generator=g)
    before, w0 = algo.personal.clone(), algo.base.clone()
    clients = np.array([0, 2])
    start = w0.repeat(2, 1)
    start[:, own] = before[clients]
    want = eng.train(start.clone(), clients, optim=algo.optim, round=0, lr=algo.optim.lr_at(0),
                     epochs=1, batch_size=8).states  # fmt: skip
    n = fed.train_sizes[clients] if weighting == "samples" else torch.ones(2)
    shared = (n[:, None] / n.sum() * want).sum(0)
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.base[~own], shared[~own])
    torch.testing.assert_close(algo.personal[clients], want[:, own])
    assert torch.equal(algo.personal[1], before[1])
    deployed = algo.personal_state(2)
    torch.testing.assert_close(deployed[own], want[1, own])
    assert torch.equal(deployed[~own], algo.base[~own])
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * (eng.n_state - int(own.sum()))


@pytest.mark.quick
def test_group_norm_stays_local_only_with_norm_all():
    algo, eng, _ = cnn_algo("group", "algo.norm=all")
    gns = norm_modules(eng, torch.nn.GroupNorm)
    assert len(gns) == 2
    names = {e.name.rsplit(".", 1)[0] for e in eng.spec.params if algo.personal_entries[e.start]}
    assert names == gns
    plain, _, _ = cnn_algo("group")  # the paper's rule: BatchNorm only, none here
    assert not plain.personal_entries.any()


# FMNIST, IID over 10 clients of 150 samples, LeNet-5 with BatchNorm, batches of 10
IID_BN = [*SMALL_FMNIST_BN_CNN, "split=iid", "clients=10", "batch_size=10", "optim.lr=0.05"]


@pytest.mark.slow
def test_learns_on_fmnist_with_a_batchnorm_cnn(tmp_path):
    """4 rounds: personal L accuracy measured 0.66 (FedAvg's global model 0.67; seed 0).
    (On pat-2 the shared classifier, global as FedBN's is, is 0.27 after 5 rounds: FedBN
    addresses feature shift, not label shift.)"""
    summary, _ = run_small(tmp_path, ["algo=fedbn"], rounds=4, base=IID_BN)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.55, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedbn", "clients=6", "batch_size=30", "eval.every=1", "checkpoint.every=1",
            "participation=0.5"]  # fmt: skip
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 3, die_at=2, base=IID_BN)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
