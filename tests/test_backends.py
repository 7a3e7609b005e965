"""Every registered algorithm gives the same run on both engine backends.

Two rounds of each algorithm on TinyFed (3 clients, an MLP 6-8-3, batch 8) with
`engine.backend=sequential` and with `engine.backend=vmap`: every tensor of the algorithm's
checkpoint state and every client's personalized predictions agree. Where vmap cannot
reproduce the sequential numbers (a custom objective, BatchNorm statistics, dropout) the
engine falls back to sequential, and both runs would take one path (the vmap run alone is
made); elsewhere it checks the algorithm's own use of the engine (its terms,
trainable masks, per-client rows) under batched training. New algorithms are covered as soon
as they are registered.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import make_algo
from fedbench.algorithms import ALGORITHMS
from fedbench.engine import Engine


def run_two_rounds(name: str, backend: str, monkeypatch):
    """(algorithm state after two rounds, each client's hits on its test data by the
    personalized and the global model, the backends the engine chose)."""
    algo, _, fed = make_algo(name, [f"engine.backend={backend}"], backend=backend)
    chosen: list[str] = []
    choose = Engine.backend_for

    def spy(self, n_clients, objective=None):
        chosen.append(choose(self, n_clients, objective))
        return chosen[-1]

    with monkeypatch.context() as m:
        m.setattr(Engine, "backend_for", spy)
        for t in range(2):
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


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_both_backends_give_the_same_run(name, caplog, monkeypatch):
    caplog.set_level(logging.WARNING)
    vm_state, vm_hits, vm_chosen = run_two_rounds(name, "vmap", monkeypatch)
    if "vmap" not in vm_chosen:
        # every train call fell back to sequential (or the algorithm trains without the
        # engine): a sequential run would take the same path
        return
    seq_state, seq_hits, seq_chosen = run_two_rounds(name, "sequential", monkeypatch)
    assert set(seq_chosen) == {"sequential"}
    assert len(vm_chosen) == len(seq_chosen)  # the same train calls
    assert_close_tree(seq_state, vm_state)
    for s, v in zip(seq_hits, vm_hits):
        # float differences of ~1e-6 may flip a prediction whose two top logits tie
        assert int((s != v).sum()) <= 1
