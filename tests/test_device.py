"""Device handling that a CPU-only machine can still check (scripts/gpu_check.sh does the rest
on a GPU, docs/gpu.md).

The `meta` device stands in for a GPU: its tensors have shapes and no data, and PyTorch
refuses to mix them with CPU tensors exactly as it refuses to mix CUDA and CPU tensors. An
algorithm built and run on `meta` therefore raises a device mismatch wherever a tensor made
on the CPU meets one on the training device, up to the first operation that needs the data
(`.item()`, `nonzero`, a copy to the CPU), which `meta` cannot run and a GPU can.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE, TinyFed, make_algo
from fedbench.algorithms import ALGORITHMS
from fedbench.config import load_config
from fedbench.errors import FedbenchError
from fedbench.runner import resolve_device

# Shorter inner loops where the defaults are long (the code paths are the same)
EXTRA = {
    "pfedhn": ["algo.inner_steps=3"],
    "plgu_ghn": ["algo.inner_steps=3"],
    "pfedme": ["algo.local_rounds=2"],
    "fedrep": ["algo.head_epochs=1"],
    "fedala": ["algo.max_start_epochs=2"],
}


def _data_dependent(e: Exception) -> bool:
    """True for the errors `meta` raises where an operation needs the tensors' values: the
    point where a meta run has to stop, which a GPU run passes."""
    return isinstance(e, NotImplementedError) or (
        isinstance(e, RuntimeError) and "meta tensor" in str(e)
    )


def _past_masks():
    """`nonzero` on meta may assume an all-nonzero input (its output's shape is then known),
    so that a meta run goes on past boolean masks; nothing where PyTorch lacks the switch."""
    try:
        from torch.fx.experimental import _config

        return _config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def _on_meta(algo: str, backend: str = "auto", extra=(), rounds: int = 1):
    """`algo` built by make_algo's recipe with TinyFed, the engine and the model on meta;
    then `rounds` rounds over every client."""
    from conftest import compose
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed().to("meta")
    cfg = compose([f"algo={algo}", "batch_size=8", "optim.lr=0.1", *extra, *EXTRA.get(algo, [])])
    torch.manual_seed(0)
    model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8])  # noqa: E731
    eng = Engine(fed, model_fn(), device="meta", backend=backend)
    with _past_masks():
        algo_obj = ALGORITHMS.get(algo).from_config(load_config(cfg), fed, eng, model_fn)
        for t in range(rounds):
            algo_obj.round(t, np.arange(fed.num_clients))
    return algo_obj


@pytest.mark.quick
def test_the_test_device_switch_moves_engine_and_data():
    """FEDBENCH_TEST_DEVICE (conftest.TEST_DEVICE, cpu by default) is where make_algo puts the
    engine and TinyFed's data and index tensors; train_sizes stays on the CPU, as in
    Federation."""
    _, eng, fed = make_algo("fedavg")
    want = torch.device(TEST_DEVICE).type
    assert eng.device.type == want
    assert {fed.x.device.type, fed.y.device.type} == {want}
    assert {i.device.type for i in fed.train_idx + fed.test_idx} == {want}
    moved = TinyFed().to("meta")
    assert moved.x.is_meta and moved.y.is_meta
    assert all(i.is_meta for i in moved.train_idx + moved.test_idx)
    assert moved.train_sizes.device.type == "cpu"


@pytest.mark.quick
def test_device_auto_picks_cuda_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(FedbenchError, match="no CUDA GPU is visible"):
        resolve_device("cuda")


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_a_fedavg_round_runs_whole_on_another_device(backend):
    """The engine's training path on both backends (schedules built on the CPU, index
    tensors, optimizer state, the weighted average) keeps every tensor on the engine's
    device: a whole FedAvg round runs on meta, and its model stays there."""
    algo = _on_meta("fedavg", backend)
    assert algo.w.is_meta and algo.engine.backend_for(3) == backend
    # the global model comes back as a module on the run's device (a CPU module before;
    # personal_model is built the same way, past an .item() that meta cannot run)
    assert all(p.is_meta for p in algo.global_model().parameters())


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_no_cpu_tensor_meets_a_device_tensor(name):
    """Building `name` and running one round on meta raises no device mismatch: it
    finishes, or stops where meta needs values (pFedLA once stacked its device hypernetwork
    with CPU ones, a crash on any GPU)."""
    try:
        _on_meta(name)
    except Exception as e:  # noqa: BLE001 (any other error is the failure reported)
        if not _data_dependent(e):
            raise


# Algorithms that finish a whole round on meta (the others stop earlier, where meta needs
# values): their checkpoints can be checked across devices end to end.
WHOLE_ON_META = [
    "apple",
    "ditto",
    "diversifed",
    "fedamp",
    "fedavg",
    "feddyn",
    "fedprox",
    "fedsam",
    "knnper",
    "local",
    "moon",
    "perfedavg",
    "pfedme",
    "scaffold",
]


@pytest.mark.quick
@pytest.mark.parametrize("name", WHOLE_ON_META)
def test_a_checkpoint_resumes_on_another_device(name):
    """As `Run._restore` does: a state saved on TEST_DEVICE after a round, loaded with
    `map_location` = the new device (meta) into an algorithm built there, then a round: no
    tensor of the checkpoint may stay where it was saved or meet a CPU one. FedAvg keeps
    momentum across rounds here, so the engine's optimizer state crosses too."""
    import io

    extra = ["optim.momentum=0.9", "optim.persist_state=true"] if name == "fedavg" else []
    algo, eng, fed = make_algo(name, [*extra, *EXTRA.get(name, [])])
    algo.round(0, np.arange(fed.num_clients))
    buf = io.BytesIO()
    torch.save({"algo": algo.state_dict(), "engine": eng.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, map_location="meta", weights_only=False)
    on_meta = _on_meta(name, extra=extra, rounds=0)
    on_meta.load_state_dict(state["algo"])
    on_meta.engine.load_state_dict(state["engine"])
    with _past_masks():
        on_meta.round(1, np.arange(fed.num_clients))
