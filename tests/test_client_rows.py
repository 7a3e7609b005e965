"""Per-client state that scales with clients (issue 33.3): rows live off the device (host
memory, a memory-mapped file past `engine.host_rows_gib`), a round moves its sampled clients'
rows only, and a checkpoint rewrites the shards of the clients that changed, each verified by
its SHA-256 when loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SMALL_FMNIST, compose, crash_and_resume, fmnist_available, make_algo
from fedbench.checkpoint import ROWS_DIR, CheckpointError, check_resume, load_run_state, save
from fedbench.engine import ClientRows, RowsPolicy


def stores(x) -> list[ClientRows]:
    if isinstance(x, ClientRows):
        return [x]
    if isinstance(x, dict):
        return [r for v in x.values() for r in stores(v)]
    return []


def state_of(n_rows: int, rows: ClientRows) -> dict:
    return {"format": 2, "progress": {"next_round": n_rows}, "algo": {"theta": rows}}


@pytest.mark.quick
@pytest.mark.parametrize("policy", ["memory", "mapped"])
def test_rows_read_their_default_until_written_and_move_to_the_device(tmp_path, policy):
    d = torch.arange(4.0)
    pol = RowsPolicy(0, tmp_path) if policy == "mapped" else RowsPolicy()
    rows = ClientRows(6, d, device="cpu", name="t", policy=pol)
    assert torch.equal(rows[[0, 5]], d.expand(2, 4)) and rows._data is None  # nothing kept
    rows[torch.tensor([1, 3])] = torch.tensor([[1.0] * 4, [3.0] * 4])
    rows[4] = torch.full((4,), 4.0)
    assert rows.mapped == (policy == "mapped")
    want = torch.stack([d, torch.ones(4), d, torch.full((4,), 3.0), torch.full((4,), 4.0), d])
    assert torch.equal(rows.all(), want) and torch.equal(rows[3], want[3])
    assert rows.dirty.nonzero().flatten().tolist() == [1, 3, 4]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # a mapped file is unlinked


@pytest.mark.quick
@pytest.mark.parametrize(
    "algo,extra",
    [
        ("fedavg", []),
        ("ditto", []),
        ("fedrep", []),
        ("local", []),
        ("scaffold", []),
        ("fedavg", ["optim.persist_state=true", "optim.momentum=0.9"]),
    ],
)
def test_a_round_touches_only_its_sampled_clients_rows(algo, extra):
    alg, eng, _ = make_algo(algo, extra)
    all_rows = stores(alg.state_dict()) + stores(eng.state_dict())
    assert all_rows  # every algorithm here keeps per-client rows
    alg.round(0, np.array([2]))  # the optimizer's rows exist from the first round
    all_rows = stores(alg.state_dict()) + stores(eng.state_dict())
    for r in all_rows:
        r.touched.zero_()
        r.dirty.zero_()
    alg.round(1, np.array([0, 2]))
    for r in all_rows:
        assert r.touched.nonzero().flatten().tolist() == [0, 2], r.name
        assert r.dirty.nonzero().flatten().tolist() in ([0, 2], []), r.name


@pytest.mark.quick
def test_a_checkpoint_writes_bytes_of_the_changed_clients_only(tmp_path):
    D, N = 1000, 50  # 4000 bytes per row, one row per shard
    rows = ClientRows(N, torch.zeros(D), device="cpu", name="theta", shard_rows=1)
    path = tmp_path / "checkpoint.pt"
    row_bytes = D * 4

    def written(changed: list[int]) -> int:
        for i in changed:
            rows[i] = torch.full((D,), float(i + 1)) + torch.rand(D)
        total, _ = save(path, state_of(len(changed), rows))
        return total - path.stat().st_size  # the shard bytes: total less checkpoint.pt

    assert written(list(range(10))) == 10 * row_bytes
    assert written([3, 17]) == 2 * row_bytes
    assert written([]) == 0
    assert written([7, 8, 9, 40, 41]) == 5 * row_bytes
    # only the files the checkpoint names remain: 10 + 1 (client 17) + 2 (40, 41)
    assert len(list((tmp_path / ROWS_DIR).iterdir())) == 13
    back = ClientRows(N, torch.zeros(D), device="cpu", name="theta", shard_rows=1)
    back.load(load_run_state(path)[0]["algo"]["theta"])
    assert torch.equal(back.all(), rows.all()) and torch.equal(back.written, rows.written)
    # a resumed store writes only what changes after its load
    back[5] = torch.ones(D)
    total, _ = save(path, state_of(1, back))
    assert total - path.stat().st_size == row_bytes


@pytest.mark.quick
def test_a_damaged_or_missing_shard_is_refused_in_one_line(tmp_path):
    rows = ClientRows(4, torch.zeros(8), device="cpu", name="theta", shard_rows=1)
    rows[[0, 2]] = torch.randn(2, 8)
    path = tmp_path / "checkpoint.pt"
    save(path, state_of(1, rows))
    shard = sorted((tmp_path / ROWS_DIR).iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    back = ClientRows(4, torch.zeros(8), device="cpu", name="theta", shard_rows=1)
    with pytest.raises(CheckpointError, match="damaged or changed") as e:
        back.load(load_run_state(path)[0]["algo"]["theta"])
    assert "\n" not in str(e.value)
    shard.unlink()
    with pytest.raises(CheckpointError, match="cannot be read") as e:
        back.load(load_run_state(path)[0]["algo"]["theta"])
    assert "\n" not in str(e.value)


@pytest.mark.quick
def test_a_resume_checks_every_shard_before_anything_is_written(tmp_path):
    cfg = compose([*SMALL_FMNIST, "rounds=2", "resume=true"])
    rows = ClientRows(4, torch.zeros(8), device="cpu", name="theta", shard_rows=1)
    rows[1] = torch.ones(8)
    from fedbench.trees import plain

    save(tmp_path / "checkpoint.pt", {**state_of(1, rows), "config": plain(cfg)})
    assert check_resume(cfg, tmp_path) is not None
    shard = next((tmp_path / ROWS_DIR).iterdir())
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="damaged"):
        check_resume(cfg, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
@pytest.mark.parametrize("algo", ["scaffold", "ditto"])
def test_resume_from_incremental_checkpoints_equals_an_uninterrupted_run(
    tmp_path, monkeypatch, algo
):
    """Checkpoints every round (each one incremental), rows in a memory-mapped file
    (host_rows_gib=0), kept momentum; killed in round 4 and resumed."""
    over = [
        f"algo={algo}",
        "participation=0.3",
        "eval.every=2",
        "checkpoint.every=1",
        "engine.host_rows_gib=0",
        "optim.momentum=0.9",
        "optim.persist_state=true",
    ]

    def incremental(run_dir):
        assert len(list((run_dir / ROWS_DIR).iterdir())) > 0

    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 5, 4, after_crash=incremental)
    assert {k: full[k] for k in ("final", "best")} == {k: resumed[k] for k in ("final", "best")}
