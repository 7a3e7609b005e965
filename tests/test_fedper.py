"""FedPer: one round against the engine by hand, the personalization layers it keeps, that it
learns on real FMNIST, and that a killed run resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import crash_and_resume, make_algo, run_small
from fedbench.config import load_config
from fedbench.errors import ConfigError


@pytest.mark.quick
@pytest.mark.parametrize("weighting,epochs", [("samples", 1), ("uniform", 2)])
def test_round_by_hand(weighting, epochs):
    """Sampled clients train (base^t, own layers) together E epochs; the server averages the
    bases (by sample count, or uniformly); each keeps its trained personal layers; the
    others keep theirs; a client deploys the latest base with its own layers."""
    algo, eng, fed = make_algo("fedper", [f"algo.weighting={weighting}", f"local_epochs={epochs}"])
    g = torch.Generator().manual_seed(1)
    algo.personal = torch.randn(algo.personal.shape, generator=g)
    before, base0 = algo.personal.clone(), algo.base.clone()
    own = algo.personal_entries
    clients = np.array([0, 2])
    start = base0.repeat(2, 1)  # by hand: the base with each client's own layers
    start[:, own] = before[clients]
    assert torch.equal(algo.states_of(clients), start)
    want = eng.train(start.clone(), clients, optim=algo.optim, round=0, lr=algo.optim.lr_at(0),
                     epochs=epochs, batch_size=8).states  # fmt: skip
    n = fed.train_sizes[clients] if weighting == "samples" else torch.ones(2)
    base = (n[:, None] / n.sum() * want).sum(0)
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.base[~own], base[~own])
    assert torch.equal(algo.base[own], base0[own])  # the base row's personal part never moves
    torch.testing.assert_close(algo.personal[clients], want[:, own])
    assert torch.equal(algo.personal[1], before[1])
    deployed = algo.personal_state(1)
    assert torch.equal(deployed[own], before[1]) and torch.equal(deployed[~own], algo.base[~own])
    moved = 2 * (eng.n_state - int(own.sum()))
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * moved


@pytest.mark.quick
def test_a2_scales_the_base_update_only():
    """Attack A2 (every client malicious here but one): the base moves by 100 times the
    honest mean update; the personal layers a client keeps are its own training's."""
    from fedbench.attack import Attack

    algo, eng, fed = make_algo("fedper")
    own = algo.personal_entries
    base0 = algo.base.clone()
    clients = np.arange(3)
    want = algo.local_train(algo.states_of(clients), clients, 0).states
    algo.attack = Attack("a2", 0.5, 3, seed=0)
    bad = torch.as_tensor(algo.attack.malicious)
    algo.round(0, clients)
    w = fed.train_sizes / fed.train_sizes.sum()
    sent = torch.where(bad[:, None], 100 * (want - base0) + base0, want)
    torch.testing.assert_close(algo.base[~own], (w[:, None] * sent).sum(0)[~own])
    torch.testing.assert_close(algo.personal, want[:, own])


@pytest.mark.quick
def test_batchnorm_statistics_of_a_personal_layer_stay_personal():
    from conftest import TinyFed, compose
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed()
    fed.x = fed.x.reshape(-1, 1, 1, 6).expand(-1, 1, 6, 6).contiguous()
    fed.input_shape = (1, 6, 6)
    opts = dict(preset=None, channels=[4, 4], fc=[8], kernel=3, padding=1, norm="batch")
    model_fn = lambda: build_model("cnn", fed.input_shape, fed.num_classes, **opts)  # noqa: E731
    eng = Engine(fed, model_fn(), device="cpu")
    cfg = load_config(compose(["algo=fedper", "algo.personal_layers=3"]))
    algo = ALGORITHMS.get("fedper").from_config(cfg, fed, eng, model_fn)
    own = algo.personal_entries
    assert len(eng.model.layers()) == 4  # conv+norm, conv+norm, fc, head
    personal_convs = {p.rsplit(".", 1)[0] for p in eng.model.layers()[1].params}
    for e in eng.spec.buffers:  # the second conv's norm is personal, the first's shared
        assert bool(own[e.start : e.stop].all()) == (e.name.rsplit(".", 1)[0] in personal_convs)
    before = algo.personal.clone()
    algo.round(0, np.array([0, 1]))
    assert not torch.equal(algo.personal[:2], before[:2])  # statistics and weights moved
    assert torch.equal(algo.personal[2], before[2])


@pytest.mark.quick
def test_personal_layers_are_the_last_ones():
    from conftest import TinyFed, compose
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed()
    model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8, 8])  # noqa: E731
    eng = Engine(fed, model_fn(), device="cpu")
    cfg = compose(["algo=fedper", "algo.personal_layers=2"])
    algo = ALGORITHMS.get("fedper").from_config(load_config(cfg), fed, eng, model_fn)
    layers = eng.model.layers()
    assert len(layers) == 3
    names = {p for layer in layers[-2:] for p in layer.params}
    assert torch.equal(algo.personal_entries[: eng.n_params], eng.spec.mask(names))
    assert not algo.personal_entries[eng.n_params :].any()  # buffers stay with the base
    with pytest.raises(ConfigError, match="personal_layers=3: the model has 3 layers"):
        ALGORITHMS.get("fedper").from_config(
            load_config(compose(["algo=fedper", "algo.personal_layers=3"])), fed, eng, model_fn
        )


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.949 in 5 rounds (seed 0); a base never averaged gives 0.85, personal
    layers not kept 0.65 (the reviewer's injected faults)."""
    summary, _ = run_small(tmp_path, ["algo=fedper", "optim.lr=0.1"], rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.9, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedper", "eval.every=2", "checkpoint.every=2", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 5, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
