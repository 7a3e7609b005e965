"""An evaluation reads one client's model at a time (issue 14.3): it never calls
`personal_states()` (which may build all N rows), and its extra peak memory, measured in a
fresh process, is a few models whatever N."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_algo
from fedbench.algorithms import ALGORITHMS
from fedbench.evaluation import evaluate

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench_eval_memory.py"

# TinyFed settings some algorithms need to run a round (small inner loops for speed)
EXTRA = {
    "pfedhn": ["algo.inner_steps=3"],
    "plgu_ghn": ["algo.inner_steps=3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_evaluation_never_calls_personal_states(name, monkeypatch):
    algo, _, fed = make_algo(name, EXTRA.get(name, []))
    algo.round(0, list(range(fed.num_clients)))

    def forbidden(self):
        raise AssertionError(f"{name}: evaluation called personal_states() (builds [N, D])")

    monkeypatch.setattr(type(algo), "personal_states", forbidden)
    res = evaluate(algo, fed)
    if algo.has_personal:
        acc = res["personal"]["L"]["acc"]
        assert len(acc) == fed.num_clients and all(0 <= a <= 1 for a in acc)


def _bench(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.long  # a memory measurement (~16 s): CI's long half
def test_evaluation_extra_peak_is_a_few_models_not_n():
    """A 2.7M-parameter MLP, 96 clients: every [N, D] row would be 96 models (1 GB); an
    evaluation of FedRep, Ditto or pFedMe adds a few models at most to the process's peak RSS
    (VmHWM after minus before, peak reset first; scripts/bench_eval_memory.py in a
    subprocess). The control evaluates through personal_states()[i], as before the fix:
    the same measurement sees its N rows."""
    if sys.platform != "linux":
        pytest.skip("peak RSS reset needs Linux /proc/self/clear_refs")
    common = ["--model", "mlp", "--hidden", "2048", "512", "--input", "1", "28", "28"]
    common += ["--classes", "10", "--clients", "96", "--threads", "1"]
    algos = ["fedrep", "ditto", "pfedme", "fedrep:all_rows", "ditto:all_rows"]
    rows = _bench(*common, "--algos", *algos)
    assert [r["algo"] for r in rows] == algos
    for r in rows:
        assert r["peak_reset"] and r["params"] > 2_000_000
        if r["algo"].endswith(":all_rows"):
            # the measurement sees the N = 96 rows (the kernel's RSS counters are approximate
            # under load: measured 43 to 64 of 64 rows)
            assert r["extra_peak_models"] > 48, r
        else:
            assert r["extra_peak_models"] < 16, r  # a few models (allocator slack included)
