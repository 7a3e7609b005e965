"""scripts/bench_algorithms.py: its table's shape, columns and arithmetic (never its timings:
no timed tests), end to end in --quick mode, and the same tables rendered again from its
raw.json; its bad input, one line and exit code 2."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fmnist_available

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_algorithms.py"
# pFedMe's multiple (R = 20 batches x K = 5 passes) would cost 25 FedAvg rounds per setting
# here; its derivation is printed in the full table (docs/performance.md)
ALGOS = ["fedavg", "ditto"]


def _script():
    """The script as a module (registered first: its dataclasses look their module up)."""
    if "bench_algorithms" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_algorithms", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_algorithms"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_algorithms"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "args",
    [["--algos", "fedavg,nosuch"], ["--settings", "mlp,gpu"], ["--rounds", "0"]],
)
def test_bad_options_one_line_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        _script().parse(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.long  # a benchmark's smoke run (~20 s): CI's long half
def test_quick_run_writes_the_table(tmp_path):
    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed (apt-get install dataset-fashion-mnist)")
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--algos", ",".join(ALGOS)]
    cmd += ["--warmup", "1", "--rounds", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=600)
    with open(out / "algorithms.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["algorithm"] for r in rows] == ALGOS
    per = ["s/round", "ratio", "multiple", "ratio/multiple", "rounds"]
    cols = ["algorithm"] + [f"{s} {c}" for s in ("MLP", "CNN") for c in per]
    assert list(rows[0]) == [*cols, "backend", "why (ratio/multiple > 1.3)"]
    by = {r["algorithm"]: r for r in rows}
    # the arithmetic, from the definitions: quick MLP n = 40, CNN n = 30, B = 10, E = 1
    assert [by["fedavg"][f"{s} multiple"] for s in ("MLP", "CNN")] == ["1.00", "1.00"]
    assert [by["ditto"][f"{s} multiple"] for s in ("MLP", "CNN")] == ["2.00", "2.00"]
    for r in rows:
        assert r["backend"].startswith("MLP ") and "; CNN " in r["backend"]
        for s in ("MLP", "CNN"):
            secs, ratio = float(r[f"{s} s/round"]), float(r[f"{s} ratio"].rstrip("x"))
            over = float(r[f"{s} ratio/multiple"])
            assert secs > 0 and ratio > 0
            assert over == pytest.approx(ratio / float(r[f"{s} multiple"]), abs=0.01)
            # a ratio over 1.3x its multiple says why, and only then
            assert (f"{s}: " in r["why (ratio/multiple > 1.3)"]) == (over > 1.3)
    text = (out / "algorithms.md").read_text()
    assert "torch " in text and "thread" in text
    assert text.count("| algorithm |") == 2  # the timings and the arithmetic's derivations
    # the tables are a function of raw.json: --render writes them again, the same
    again = tmp_path / "again"
    _script().main(["--render", str(out / "raw.json"), "--out", str(again)])
    assert (again / "algorithms.md").read_text() == text
    assert (again / "algorithms.csv").read_text() == (out / "algorithms.csv").read_text()


@pytest.mark.quick
def test_the_probes_pass_every_argument_through():
    """The traced Engine methods take what the real ones take (`backend_for`'s keyword
    `client_steps` once made every pFedMe and Per-FedAvg row an error) and still count."""
    from conftest import TinyFed
    from fedbench.engine import Engine
    from fedbench.models import build_model

    mod = _script()
    fed = TinyFed()
    eng = Engine(fed, build_model("mlp", fed.input_shape, 3, hidden=[8]), device="cpu")
    with mod.Probes() as probes:
        probes.trace = mod.Trace()
        assert eng.backend_for(3, client_steps=True) == "sequential"
        assert eng.backend_for(3) == "vmap"
    assert probes.trace.backends == {"sequential": 1, "vmap": 1}
