"""FedBABU: the head never moves from its initialization, the body average by hand, the
fine-tuned personalized models against a direct engine call (one call for all clients,
kept until the global model changes), that it learns on real FMNIST, and that a killed run
resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TinyFed, crash_and_resume, make_algo, run_small
from fedbench.algorithms.fedbabu import FINETUNE_SALT


@pytest.mark.quick
@pytest.mark.parametrize("weighting,epochs", [("samples", 1), ("uniform", 2)])
def test_round_by_hand(weighting, epochs):
    """Sampled clients train the body of (body^t, head^0) E epochs, the head frozen; the
    server averages the bodies (by sample count, or uniformly); only the body moves."""
    algo, eng, fed = make_algo("fedbabu", [f"algo.weighting={weighting}", f"local_epochs={epochs}"])
    head = algo.head_entries
    w0 = algo.w.clone()
    assert torch.equal(w0, eng.initial_state())
    clients = np.array([0, 2])
    body_mask = ~eng.spec.mask(eng.model.head_params())
    want = eng.train(w0, clients, optim=algo.optim, lr=algo.optim.lr_at(0), epochs=epochs,
                     batch_size=8, trainable=body_mask).states  # fmt: skip
    assert torch.equal(want[:, head], w0[head].expand(2, -1))  # frozen: exactly the init
    n = fed.train_sizes[clients] if weighting == "samples" else torch.ones(2)
    body = (n[:, None] / n.sum() * want).sum(0)
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.w[~head], body[~head])
    assert torch.equal(algo.w[head], w0[head])
    assert torch.equal(algo.global_state(), algo.w)
    moved = 2 * (eng.n_state - int(head.sum()))
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * moved


@pytest.mark.quick
@pytest.mark.parametrize("attack", ["none", "a1"])
def test_head_never_changes_across_rounds(attack):
    """Four rounds (under attack A1 too, whose uploads are N(0, I) everywhere): the global
    head is the initial head, bit for bit; the body moves every round."""
    from fedbench.attack import Attack

    algo, eng, _ = make_algo("fedbabu")
    if attack == "a1":
        algo.attack = Attack("a1", 0.5, 3, seed=0)
    head = algo.head_entries
    w0 = eng.initial_state()
    for t, clients in enumerate([[0, 1], [2], [0, 1, 2], [1, 2]]):
        before = algo.w.clone()
        algo.round(t, np.array(clients))
        assert torch.equal(algo.w[head], w0[head]), t
        assert not torch.equal(algo.w[~head], before[~head]), t


@pytest.mark.quick
@pytest.mark.parametrize("part", ["full", "head", "body"])
def test_personalized_models_are_one_finetuning_call(part, monkeypatch):
    """Client i deploys the global model fine-tuned on its own data: `finetune_epochs` epochs
    of `finetune_part`, the run's optimizer from a fresh state at the lr of the last round,
    batches of their own salt: a direct engine.train call. All N clients come from one call,
    kept until the next round."""
    over = [f"algo.finetune_part={part}", "optim.momentum=0.9", "optim.persist_state=true",
            "optim.lr_decay=0.5"]  # fmt: skip
    algo, eng, _ = make_algo("fedbabu", over)
    algo.round(0, np.array([0, 1]))
    algo.round(1, np.array([1, 2]))
    g = algo.w.clone()
    head = eng.spec.mask(eng.model.head_params())
    mask = {"full": None, "head": head, "body": ~head}[part]
    fresh = algo.optim.replace(persist_state=False)
    want = eng.train(g, np.arange(3), optim=fresh, lr=algo.optim.lr_at(1), batch_size=8,
                     epochs=5, trainable=mask, round=1, salt=FINETUNE_SALT).states  # fmt: skip
    calls = []
    real = eng.train
    monkeypatch.setattr(eng, "train", lambda *a, **k: calls.append(k) or real(*a, **k))
    got = torch.stack([algo.personal_state(i) for i in range(3)])
    assert len(calls) == 1 and calls[0]["epochs"] == 5  # one call for all clients
    torch.testing.assert_close(got, want)
    assert not torch.equal(got[0], got[1])  # each client's own data
    entries = algo.head_entries
    if part == "head":
        assert torch.equal(got[:, ~entries], g[~entries].expand(3, -1))
    if part == "body":
        assert torch.equal(got[:, entries], g[entries].expand(3, -1))
    assert torch.equal(algo.w, g)  # fine-tuning leaves the global model alone
    algo.round(2, np.array([0]))
    g2 = algo.w.clone()
    got2 = algo.personal_state(0)
    assert len(calls) == 3  # the round's training, then a new fine-tuning of the new model
    # the second fine-tuning starts from a fresh optimizer too (persist_state is on: momentum
    # left by the first fine-tuning must not carry over)
    want2 = real(g2, np.arange(3), optim=fresh, lr=algo.optim.lr_at(2), batch_size=8, epochs=5,
                 trainable=mask, round=2, salt=FINETUNE_SALT).states  # fmt: skip
    torch.testing.assert_close(got2, want2[0])


@pytest.mark.quick
def test_no_finetuning_deploys_the_global_model():
    algo, _, _ = make_algo("fedbabu", ["algo.finetune_epochs=0"])
    algo.round(0, np.array([0, 2]))
    assert all(torch.equal(algo.personal_state(i), algo.w) for i in range(3))


class AugmentedFed(TinyFed):
    """TinyFed whose training reads are shifted by the engine's keyed augmentation draws."""

    def __init__(self) -> None:
        super().__init__()
        self.augment = True

    def batch(self, idx, train=True, draws=None):
        x, y = super().batch(idx, train)
        if train:
            x = x + 0.1 * draws[:, :1].to(x.dtype)  # a crop offset as a shift
        return x, y


@pytest.mark.quick
def test_evaluating_does_not_change_training_under_augmentation():
    """Fine-tuning at an evaluation reads augmented batches, keyed by (round, client, salt):
    a round after an evaluation trains exactly as without it (eval.every never changes a
    run)."""
    runs = []
    for evaluate in (False, True):
        algo, _, fed = make_algo("fedbabu", ["algo.finetune_epochs=1"], fed=AugmentedFed())
        algo.round(0, np.arange(3))
        if evaluate:
            algo.personal_state(0)  # fine-tunes every client: augmented reads
        algo.round(1, np.arange(3))
        runs.append(algo.w.clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.quick
def test_finetune_lr_fixed_or_the_rounds():
    algo, eng, _ = make_algo("fedbabu", ["algo.finetune_lr=0.001", "optim.lr_decay=0.5"])
    calls = []
    real = eng.train
    eng.train = lambda *a, **kw: calls.append(kw["lr"]) or real(*a, **kw)
    algo.round(3, np.arange(3))
    algo.personal_state(0)
    assert calls[-1] == 0.001
    algo, eng, _ = make_algo("fedbabu", ["optim.lr_decay=0.5"])
    calls.clear()
    real = eng.train
    eng.train = lambda *a, **kw: calls.append(kw["lr"]) or real(*a, **kw)
    algo.round(3, np.arange(3))
    algo.personal_state(0)
    assert calls == [0.1 * 0.5**3] * 2  # the round's training and its fine-tuning


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured (seed 0, 2 rounds): personalized (fine-tuned 5 epochs) 0.957, global (the
    averaged body with the random head) 0.589; without fine-tuning (finetune_epochs=0) the
    personalized score is the global one, 0.589."""
    summary, _ = run_small(tmp_path, ["algo=fedbabu", "optim.lr=0.1"], rounds=2)
    acc = summary["final"]["personal"]["L"]["avg"]
    glob = summary["final"]["global"]["all"]
    assert acc > 0.9, acc
    assert 0.4 < glob < acc - 0.2, (glob, acc)


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedbabu", "clients=10", "eval.every=2", "checkpoint.every=2",
            "participation=0.5", "algo.finetune_epochs=1"]  # fmt: skip
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 4, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
