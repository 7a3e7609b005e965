"""Malicious clients (fedbench/attack.py): A1/A2 change exactly the malicious rows as the
FedPG appendix (B.3) and docs/papers/fedpg.md say; the runner builds the attack, refuses algorithms
it cannot reach, scores honest clients only and records how many were malicious."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import SMALL_FMNIST, compose, fmnist_available
from fedbench.attack import Attack
from fedbench.errors import ConfigError


def _attack(kind, a1_grad="scaled", n=10, seed=3):
    return Attack(kind, 0.3, n, seed, a1_grad)


@pytest.mark.quick
def test_malicious_set_is_drawn_from_the_seed():
    a, b, c = _attack("a1"), _attack("a1"), _attack("a1", seed=4)
    assert a.count == 3 and (a.malicious == b.malicious).all()
    assert not (a.malicious == c.malicious).all() or a.count == c.count
    assert Attack("a2", 0.1, 100, 0, "scaled").count == 10


def _split(a, clients):
    mal = a.malicious[clients]
    return np.flatnonzero(mal), np.flatnonzero(~mal)


@pytest.mark.quick
def test_a1_on_models_replaces_malicious_parameters_with_gaussians_only():
    a = _attack("a1")
    clients = np.arange(10)
    up = torch.randn(10, 5000) + 3.0
    before = up.clone()
    ref = torch.zeros(5000)
    gen = torch.Generator().set_state(a._gen.get_state())
    out = a.apply(up, clients, ref=ref, kind="model", n_params=4000)
    bad, good = _split(a, clients)
    assert torch.equal(out[good], up[good])
    assert torch.equal(out[bad, 4000:], up[bad, 4000:])  # buffers untouched
    x = out[bad, :4000]
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    assert torch.equal(up, before)  # the input is not modified
    # exactly the generator's next draws, one N(0, I) per malicious row in order
    assert torch.equal(x, torch.stack([torch.randn(4000, generator=gen) for _ in bad]))


@pytest.mark.quick
def test_a2_on_models_scales_the_update_100_times():
    a = _attack("a2")
    clients = np.array([9, 0, 4, 7, 2])
    up = torch.randn(5, 30)
    ref = torch.randn(5, 30)
    out = a.apply(up, clients, ref=ref, kind="model", n_params=20)
    bad, good = _split(a, clients)
    assert torch.equal(out[good], up[good])
    exp = 100 * (up[bad, :20] - ref[bad, :20]) + ref[bad, :20]
    assert torch.allclose(out[bad, :20], exp)
    assert torch.equal(out[bad, 20:], up[bad, 20:])


@pytest.mark.quick
def test_attacks_on_gradients():
    clients = np.arange(10)
    g = torch.randn(10, 50)
    ref = torch.randn(50)
    before = g.clone()
    a = _attack("a1", "scaled")
    gen = torch.Generator().set_state(a._gen.get_state())
    out = a.apply(g, clients, ref=ref, kind="grad")
    assert torch.equal(g, before)  # the input is not modified
    bad, good = _split(a, clients)
    assert torch.equal(out[good], g[good])
    # (w - xi) / ||w - xi|| ||g_i||, xi the generator's next draw for each malicious row
    for r in bad:
        v = ref - torch.randn(50, generator=gen)
        assert torch.allclose(out[r], v / v.norm() * g[r].norm(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(out[bad].norm(dim=1), g[bad].norm(dim=1), rtol=1e-5)
    raw = _attack("a1", "gaussian").apply(g, clients, ref=ref, kind="grad")
    assert torch.equal(raw[good], g[good])
    assert float(raw[bad].norm(dim=1).mean()) == pytest.approx(50**0.5, rel=0.35)
    a2 = _attack("a2").apply(g, clients, ref=ref, kind="grad")
    assert torch.equal(a2[good], g[good]) and torch.allclose(a2[bad], 100 * g[bad])


@pytest.mark.quick
def test_loss_reports_pass_and_other_uploads_are_attacked():
    a = _attack("a2")
    clients = np.arange(10)
    L = torch.rand(10, 1)
    assert a.apply(L, clients, kind="loss") is L
    other = torch.randn(10, 3, 4)
    out = a.apply(other, clients, kind="other")
    bad, good = _split(a, clients)
    assert torch.equal(out[good], other[good]) and torch.allclose(out[bad], 100 * other[bad])
    o1 = _attack("a1").apply(other, clients, kind="other")
    assert torch.equal(o1[good], other[good]) and not torch.allclose(o1[bad], other[bad])


@pytest.mark.quick
def test_bad_config_values_are_config_errors():
    with pytest.raises(ConfigError):
        Attack("a3", 0.1, 10, 0)
    with pytest.raises(ConfigError):
        Attack("a1", 0.0, 10, 0)
    with pytest.raises(ConfigError):
        Attack("a1", 0.1, 10, 0, "noise")


@pytest.mark.slow
def test_runner_refuses_unreachable_algorithms_and_scores_honest_clients(tmp_path):
    from fedbench.runner import Run

    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed")
    base = [*SMALL_FMNIST, "rounds=2", "attack.kind=a2", "attack.fraction=0.1"]
    with pytest.raises(ConfigError, match="attack"):
        Run(compose([*base, "algo=local"]), tmp_path / "x", progress=False)
    run = Run(compose([*base, "algo=fedmgda"]), tmp_path / "y", progress=False)
    summary = run.run()
    assert summary["malicious"] == 2
    bad = set(np.flatnonzero(run.attack.malicious).tolist())
    saved = json.loads((tmp_path / "y" / "summary.json").read_text())
    assert saved["malicious"] == 2
    import pandas as pd

    clients = set(pd.read_csv(tmp_path / "y" / "clients.csv")["client"].unique().tolist())
    assert clients == set(range(20)) - bad


@pytest.mark.quick
def test_global_all_pools_only_honest_clients_test_sets():
    """GM (`all`): under an attack, the pooled test sets of honest clients only."""
    from fedbench.evaluation import evaluate

    class Fed:
        num_clients = 3
        y = torch.zeros(9)
        test_idx = [torch.arange(0, 3), torch.arange(3, 6), torch.arange(6, 9)]
        s_idx = g_idx = None

    class Algo:
        has_personal, has_global, extra_kinds = False, True, ()

        @staticmethod
        def global_correct(idx):  # right on clients 0 and 2's samples, wrong on client 1's
            return (idx < 3) | (idx >= 6)

    assert evaluate(Algo(), Fed())["global"]["all"] == pytest.approx(6 / 9)
    honest = np.array([True, False, True])
    assert evaluate(Algo(), Fed(), honest=honest)["global"]["all"] == pytest.approx(1.0)
    honest = np.array([False, True, True])
    assert evaluate(Algo(), Fed(), honest=honest)["global"]["all"] == pytest.approx(3 / 6)


@pytest.mark.slow
def test_a1_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """The attack's Gaussian stream is checkpointed: the resumed A1 run draws the same noise."""
    from conftest import crash_and_resume

    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed")
    over = [
        "algo=fedpg",
        "attack.kind=a1",
        "attack.fraction=0.3",
        "participation=0.5",
        "eval.every=2",
        "checkpoint.every=2",
    ]
    full, out = crash_and_resume(tmp_path, monkeypatch, over, 5, die_at=3)
    assert {k: out[k] for k in ("final", "best")} == {k: full[k] for k in ("final", "best")}
