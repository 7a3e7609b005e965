"""FedPer: one round against the engine by hand, the personalization layers it keeps, that it
learns on real FMNIST, and that a killed run resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import crash_and_resume, make_algo, run_small
from fedbench.errors import ConfigError


@pytest.mark.quick
def test_round_by_hand():
    """Sampled clients train (base^t, own layers) together; the server averages the bases
    by sample count; each keeps its trained personal layers; the others keep theirs."""
    algo, eng, fed = make_algo("fedper")
    g = torch.Generator().manual_seed(1)
    algo.personal = torch.randn(algo.personal.shape, generator=g)
    before = algo.personal.clone()
    clients = np.array([0, 2])
    start = algo.states_of(clients)
    shared = ~algo.personal_entries
    assert torch.equal(start[:, shared], algo.base.expand(2, -1)[:, shared])
    want = algo.local_train(start.clone(), clients, 0).states  # the same engine call, by hand
    n = fed.train_sizes[clients]
    base = (n[:, None] / n.sum() * want).sum(0)
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.base[~algo.personal_entries], base[~algo.personal_entries])
    torch.testing.assert_close(algo.personal[clients], want[:, algo.personal_entries])
    assert torch.equal(algo.personal[1], before[1])
    deployed = algo.personal_state(1)
    assert torch.equal(deployed[algo.personal_entries], before[1])
    assert torch.equal(deployed[~algo.personal_entries], algo.base[~algo.personal_entries])
    moved = 2 * (eng.n_state - int(algo.personal_entries.sum()))
    assert info["bytes_up"] == info["bytes_down"] == 4 * moved


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
    algo = ALGORITHMS.get("fedper")(cfg, fed, eng, model_fn)
    layers = eng.model.layers()
    assert len(layers) == 3
    names = {p for layer in layers[-2:] for p in layer.params}
    assert torch.equal(algo.personal_entries[: eng.n_params], eng.spec.mask(names))
    assert not algo.personal_entries[eng.n_params :].any()  # buffers stay with the base
    with pytest.raises(ConfigError, match="personal_layers=3: the model has 3 layers"):
        ALGORITHMS.get("fedper")(
            compose(["algo=fedper", "algo.personal_layers=3"]), fed, eng, model_fn
        )


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    summary, _ = run_small(tmp_path, ["algo=fedper", "optim.lr=0.1"], rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.9, acc


@pytest.mark.slow
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedper", "eval.every=2", "checkpoint.every=2", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 5, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
