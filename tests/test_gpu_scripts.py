"""The arithmetic of the GPU scripts (docs/gpu.md), which run where no test does: how
gpu_check.py judges a GPU run against the CPU reference, and how bench_column.py
extrapolates a table column's wall time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_column  # noqa: E402
import gpu_check  # noqa: E402

pytestmark = pytest.mark.quick


def record(loss=(2.0, 1.5), acc=0.8, norm=10.0, proj=3.0) -> dict:
    return {
        "status": "ok",
        "train_loss": list(loss),
        "acc": {"personal.L": acc, "global.L": acc - 0.1},
        "state": {"norm": norm, "proj": proj, "numel": 100},
    }


def test_a_run_agrees_within_the_stated_tolerance_and_not_beyond():
    ref = record()
    tol = gpu_check.TOL
    # rounding-sized differences pass
    status, note, d = gpu_check.compare("fedavg", record(loss=(2.0 * (1 + 5e-4), 1.5)), ref)
    assert status == "pass" and note == "" and d["loss_rel"] == pytest.approx(5e-4)
    # each quantity just over its tolerance fails, and the note names it
    over_loss = record(loss=(2.0, 1.5 * (1 + 2 * tol.loss_rel)))
    over_state = record(proj=3.0 + 2 * tol.state_rel * 10.0)  # |d proj| / norm = 2 tol
    over_acc = record(acc=0.8 + 2 * tol.acc_abs)
    for got, key in ((over_loss, "loss_rel"), (over_state, "state_rel"), (over_acc, "acc_abs")):
        status, note, d = gpu_check.compare("fedavg", got, ref)
        assert status == "fail" and note.startswith(key), (key, note)
        assert d[key] == pytest.approx(2 * getattr(tol, key))


def test_a_runs_measured_sensitivity_widens_its_tolerance_and_no_further():
    """A reference run that moved by 1e-3 of its norm when its initial weights were perturbed
    by 1e-6 (a discrete choice flipped on a near-tie) allows 3x that; other runs keep TOL."""
    ref = record()
    ref["sensitivity"] = {"loss_rel": 1e-7, "state_rel": 1e-3, "acc_abs": 0.0}
    within = record(proj=3.0 + 2.5e-3 * 10.0)  # 2.5e-3 of the norm: over TOL, under 3e-3
    status, note, _ = gpu_check.compare("fedcac", within, ref)
    assert status == "pass" and "tolerance from its sensitivity: state_rel 0.003" in note
    beyond = record(proj=3.0 + 3.5e-3 * 10.0)
    assert gpu_check.compare("fedcac", beyond, ref)[0] == "fail"
    del ref["sensitivity"]
    assert gpu_check.compare("fedcac", within, ref)[0] == "fail"


def test_the_perturbation_moves_every_initialization_by_rounding_size_only():
    import torch

    torch.manual_seed(0)
    plain = torch.nn.Linear(20, 30).weight.detach().clone()
    with gpu_check.perturbed_init(1e-6):
        torch.manual_seed(0)
        moved = torch.nn.Linear(20, 30).weight.detach()
    rel = ((moved - plain).abs() / plain.abs().clamp_min(1e-12)).max()
    assert 0 < rel < 1e-5
    torch.manual_seed(0)
    assert torch.equal(torch.nn.Linear(20, 30).weight, plain)  # restored


def test_errors_missing_entries_and_device_random_streams():
    ref = record()
    refused = {"status": "error", "error": "ConfigError: algo.x must be > 0"}
    assert gpu_check.compare("fedavg", refused, refused)[0] == "pass"  # refused on both
    assert gpu_check.compare("fedavg", refused, ref)[0] == "fail"
    assert gpu_check.compare("fedavg", ref, refused)[0] == "fail"
    assert gpu_check.compare("fedavg", ref, None)[0] == "fail"  # stale reference
    nan = record(loss=(2.0, float("nan")))
    assert gpu_check.compare("fedavg", nan, ref)[0] == "fail"
    # FedCP's device generator: any finite numbers pass, not compared; non-finite fails
    far = record(loss=(9.0, 9.0), acc=0.1, proj=-50.0)
    status, note, _ = gpu_check.compare("fedcp", far, ref)
    assert status == "pass" and "not compared" in note
    assert gpu_check.compare("fedcp", nan, ref)[0] == "fail"


def test_state_fingerprint_sees_any_entry_and_ignores_non_floats():
    import torch

    state = {"w": torch.arange(6.0), "rows": [torch.ones(2, 3)], "seen": torch.ones(3).bool()}
    a = gpu_check.state_fingerprint(state)
    assert a["numel"] == 12 and a["norm"] == pytest.approx((55 + 6) ** 0.5)
    moved = {**state, "w": torch.arange(6.0).flip(0)}  # same norm, other entries
    b = gpu_check.state_fingerprint(moved)
    assert b["norm"] == pytest.approx(a["norm"]) and abs(b["proj"] - a["proj"]) > 1e-3


def test_a_column_is_extrapolated_from_the_rounds_after_the_first():
    # 4 rounds done at 3.0, 4.0, 5.0, 6.0 s of the loop; the process ran 10 s in all
    done = [(1, 3.0), (2, 4.0), (3, 5.0), (4, 6.0)]
    est = bench_column.estimate(done, process_s=10.0, target=500, finished=False)
    # overhead 10 - 6 = 4 s; 1 s per round from round 2 on: 4 + 3 + 499 * 1
    assert est["s_per_round"] == 1.0 and est["overhead_s"] == 4.0
    assert est["total_s"] == 506.0 and est["status"] == "extrapolated from 4 rounds"
    one = bench_column.estimate([(1, 2.5)], process_s=5.0, target=10, finished=False)
    assert one["total_s"] == 2.5 + 2.5 + 9 * 2.5  # one round: its time stands for every round
    whole = bench_column.estimate(done, process_s=10.0, target=4, finished=True)
    assert whole["total_s"] == 10.0 and whole["status"] == "measured"


def test_the_quick_tests_outcome_is_read_from_the_xml_or_from_the_log(tmp_path):
    xml = tmp_path / "tests.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad">'
        '<failure message="AssertionError: 1 != 2&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    status, summary, details, _ = gpu_check.tests_check("fail", "1", "9", str(xml), "-")
    assert status == "fail" and details["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert details["failed"] == {"tests.test_a::test_bad": "AssertionError: 1 != 2"}
    # stopped by the time limit: no XML, the verbose log's lines instead
    log = tmp_path / "tests.log"
    log.write_text(
        "[gw0] [ 1%] PASSED tests/test_device.py::test_ok \n"
        "[gw1] [ 2%] FAILED tests/test_device.py::test_bad \n"
        "tests/test_dirs.py::test_slow \n"
    )
    status, summary, details, _ = gpu_check.tests_check(
        "fail", "124", "150", str(tmp_path / "none.xml"), str(log)
    )
    assert status == "fail" and details["counts"] == {"passed": 1, "failed": 1}
    assert "stopped at its time limit" in summary and "tests/test_device.py::test_bad" in summary
