"""Every registered algorithm gives the same run on both engine backends.

Two rounds of each algorithm on TinyFed (3 clients, an MLP 6-8-3, batch 8) with
`engine.backend=sequential` and with `engine.backend=vmap`: every tensor of the algorithm's
checkpoint state and every client's personalized predictions agree. One round of each on
a smaller TinyFed of 1x6x6 images through a BatchNorm CNN (running statistics as per-client batched
buffers, batches of unequal length at an epoch's end), with and without random crops and
flips (`data.augment`: draws keyed by seed, round, client, salt and batch), the same way;
two algorithms also through a small WideResNet with dropout (`KeyedDropout`: masks keyed
the same way). Custom objectives (FedProto, FedRoD, MOON, ...) run on vmap at each client's
mapped state; where vmap cannot run the sequential computation (torch's own `nn.Dropout`,
FedCP's Gumbel noise) the engine falls back to sequential, and both runs would take one
path (the vmap run alone is made);
elsewhere it checks the algorithm's own use of the engine (its terms, trainable masks,
per-client rows) under batched training. New algorithms are covered as soon as they are
registered.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import TinyFed, make_algo
from fedbench.algorithms import ALGORITHMS
from fedbench.data.federation import Federation
from fedbench.engine import Engine
from fedbench.models import build_model


class ImageFed(TinyFed):
    """3 clients with 13, 6 and 17 samples (batches of 8: an epoch ends on a short batch of
    another length per client) as 1x6x6 images; `augment`: training reads are cropped and
    flipped as the engine's draws say (`Federation`'s own augmentation)."""

    def __init__(self, augment: bool) -> None:
        super().__init__(sizes=(13, 6, 17), dim=36)
        self.x = self.x.view(-1, 1, 6, 6)
        self.input_shape = (1, 6, 6)
        self.augment = augment

    def batch(self, idx, train=True, draws=None):
        x, y = super().batch(idx, train)
        if train and self.augment:
            x = Federation._augment(x, draws)
        return x, y


def bn_cnn(fed):
    """conv 3x3 (2 channels) -> BatchNorm -> ReLU -> maxpool -> FC 4 -> head."""
    return build_model(
        "cnn", fed.input_shape, fed.num_classes, channels=[2], fc=[4], kernel=3, padding=1,
        norm="batch",
    )  # fmt: skip


def wrn_dropout(fed):
    """WideResNet-10-1 (one pre-activation block per stage, GroupNorm), dropout 0.3."""
    return build_model("wrn28_10", fed.input_shape, fed.num_classes, depth=10, widen=1, dropout=0.3)


def run_rounds(
    name: str, backend: str, monkeypatch, rounds: int = 2, image=None, extra=(), model_fn=None
):
    """(algorithm state after `rounds` rounds, each client's hits on its test data by the
    personalized and the global model, the backends the engine chose). `image`: None (the
    MLP on TinyFed), or whether the BatchNorm CNN (or `model_fn`'s model) on ImageFed reads
    augmented batches."""
    kw = {} if image is None else {"fed": ImageFed(image), "model_fn": model_fn or bn_cnn}
    algo, _, fed = make_algo(name, [f"engine.backend={backend}", *extra], backend=backend, **kw)
    chosen: list[str] = []
    choose = Engine.backend_for

    def spy(self, n_clients, objective=None, **kw):
        chosen.append(choose(self, n_clients, objective, **kw))
        return chosen[-1]

    with monkeypatch.context() as m:
        m.setattr(Engine, "backend_for", spy)
        for t in range(rounds):
            algo.round(t, np.arange(fed.num_clients))
        with torch.no_grad():
            hits = []
            for i in range(fed.num_clients):
                idx = torch.as_tensor(fed.test_idx[i])
                if algo.has_personal:
                    hits.append(algo.personal_correct(i, idx))
                if algo.has_global:
                    hits.append(algo.global_correct(idx))
    return algo.state_dict(), hits, chosen


def assert_close_tree(a, b, path: str = "state") -> None:
    from fedbench.engine.rows import ClientRows

    if isinstance(a, ClientRows):  # per-client rows off the device: compare every row
        assert isinstance(b, ClientRows), path
        a, b = a.all(), b.all()
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_close_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, f"{path}[{k}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=path)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5), path
    else:
        assert a == b, path


# State that is a discontinuous function of the trained models, left out of the BatchNorm /
# augmentation comparison (its inputs are compared): FedCAC's theta takes top-tau masks of
# |(after - before) * after| per layer, and a 1e-8 difference between the backends' trained
# models can swap a parameter at the threshold (no test may hang on such a tie).
DISCONTINUOUS = {"fedcac": {"theta"}}


# Algorithms whose client loops run on `Engine.client_steps`: their vmap run must map (a
# silent fall-back to sequential would compare a run with itself); the overrides that put
# them there where their default config does not (Ditto's interleaved mode).
CLIENT_STEPS = {
    "apple": [],
    "ditto": ["algo.interleave=true"],
    "fedslr": [],
    "perfedavg": [],
    "pfedhn": [],
    "pfedme": [],
    "plgu_ghn": [],
    "plgu_grep": [],
    "plgu_lf": [],
}
# Algorithms with a custom objective that vmap runs (`client_row`): their vmap run must map.
MAPPED_OBJECTIVES = {
    "apfl", "feddbe", "fedem", "fedpac", "fedproto", "fedrod", "gpfl", "moon", "splitgp"
}  # fmt: skip
# Settings that keep a case within seconds (pFedMe's 20 batches x 5 inner steps are 100
# mapped gradients per round, about 30 s through the BatchNorm CNN on 2 CPU cores).
CHEAP = {
    "pfedme": ["algo.local_rounds=3", "algo.inner_steps=2"],
    "pfedhn": ["algo.inner_steps=3"],
    "plgu_ghn": ["algo.inner_steps=3"],
}
# The unequal-step case's settings: one epoch per visit; pFedHN's clients all at once (its
# `server_update: sequential` visits one client per call).
UNEQUAL = {
    "pfedme": ["algo.local_rounds=null"],
    "pfedhn": ["algo.inner_epochs=1", "algo.hypernet.server_update=mean"],
    "plgu_ghn": ["algo.inner_epochs=1", "algo.hypernet.server_update=mean"],
}


def assert_same_runs(
    name: str, monkeypatch, rounds: int, image=None, extra=(), model_fn=None
) -> None:
    """The vmap run equals the sequential one (where vmap ran at all)."""
    extra = (*CHEAP.get(name, ()), *extra)
    vm_state, vm_hits, vm_chosen = run_rounds(
        name, "vmap", monkeypatch, rounds, image, extra, model_fn
    )
    if name in CLIENT_STEPS or name in MAPPED_OBJECTIVES or model_fn is not None:
        assert "vmap" in vm_chosen, vm_chosen
    if "vmap" not in vm_chosen:
        # every train call fell back to sequential (or the algorithm trains without the
        # engine): a sequential run would take the same path
        return
    seq_state, seq_hits, seq_chosen = run_rounds(
        name, "sequential", monkeypatch, rounds, image, extra, model_fn
    )
    assert set(seq_chosen) == {"sequential"}
    assert len(vm_chosen) == len(seq_chosen)  # the same train calls
    skip = DISCONTINUOUS.get(name, set()) if image is not None else set()
    if skip:
        seq_state = {k: v for k, v in seq_state.items() if k not in skip}
        vm_state = {k: v for k, v in vm_state.items() if k not in skip}
        seq_hits = vm_hits = []  # the personalized models are the skipped state
    assert_close_tree(seq_state, vm_state)
    for s, v in zip(seq_hits, vm_hits):
        # float differences of ~1e-6 may flip a prediction whose two top logits tie
        assert int((s != v).sum()) <= 1


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_both_backends_give_the_same_run(name, caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    assert_same_runs(name, monkeypatch, rounds=2)


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_both_backends_agree_on_batchnorm_and_augmentation(name, caplog, monkeypatch):
    """A BatchNorm CNN with augmentation: per-client running statistics and keyed crops and
    flips at once (one case per algorithm keeps the suite's time)."""
    caplog.set_level(logging.WARNING)
    assert_same_runs(name, monkeypatch, rounds=1, image=True)


# Algorithms that reach dropout through a run rather than tests/test_dropout.py's direct
# engine calls (`train`, SAM, `client_steps`, `full_grads`): MOON's custom objective (the
# model in training mode beside the global and previous ones in evaluation mode), FedPG's
# full gradients and line search.
DROPOUT_CASES = ["fedpg", "moon"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.long) if n == "moon" else n for n in DROPOUT_CASES]
)  # MOON's case (~12 s) runs in CI's long half
def test_both_backends_agree_with_dropout(name, caplog, monkeypatch):
    """A WideResNet with dropout 0.3 and augmentation: keyed masks (and crops) on vmap are
    the sequential backend's, so vmap runs it and gives the same run."""
    caplog.set_level(logging.WARNING)
    assert_same_runs(name, monkeypatch, rounds=1, image=True, model_fn=wrn_dropout)


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(CLIENT_STEPS))
def test_client_steps_with_unequal_step_counts(name, caplog, monkeypatch):
    """`Engine.client_steps` over clients that take 2, 1 and 3 steps (one epoch of ImageFed's
    13, 6 and 17 samples in batches of 8; pFedMe with `local_rounds: null`; Per-FedAvg's
    pairs of batches, an unpaired last one): on vmap the clients that still have a batch
    step together, the others keep their rows; pFedHN and PLGU-GHN with `server_update:
    mean`, one epoch per visit)."""
    caplog.set_level(logging.WARNING)
    extra = UNEQUAL.get(name, []) + CLIENT_STEPS[name]
    assert_same_runs(name, monkeypatch, rounds=1, image=True, extra=extra)


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(n for n, o in CLIENT_STEPS.items() if o))
def test_client_steps_of_a_non_default_mode(name, caplog, monkeypatch):
    """A mode that runs on `Engine.client_steps` only when configured (Ditto's interleaved
    steps): two rounds on the MLP, as every algorithm's default above."""
    caplog.set_level(logging.WARNING)
    assert_same_runs(name, monkeypatch, rounds=2, extra=CLIENT_STEPS[name])


@pytest.mark.quick
@pytest.mark.parametrize("name", ["fedala", "fedspa"])
def test_own_training_forwards_drop_by_key(name):
    """FedALA's weight learning and FedSPA's pruning gradient are training forwards outside
    `Engine.train`: with keyed dropout their masks come from (seed, round, client, salt), so
    two runs equal whatever torch's global generator holds (a resume draws the same)."""
    runs = []
    for global_seed in (0, 1):
        extra = ["engine.backend=sequential", "algo.max_start_epochs=1"] if name == "fedala" else []
        algo, _, fed = make_algo(
            name, extra or ["engine.backend=sequential"], fed=ImageFed(False),
            backend="sequential", model_fn=wrn_dropout,
        )  # fmt: skip
        torch.manual_seed(global_seed)  # what nn.Dropout would draw from; keyed masks do not
        for t in range(2 if name == "fedala" else 1):  # FedALA's weight learning: round 1 on
            algo.round(t, np.arange(fed.num_clients))
        runs.append(algo.state_dict())
    assert_close_tree(runs[0], runs[1])
