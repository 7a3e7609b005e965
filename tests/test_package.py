"""A package, not only a checkout: the wheel carries the configs (fedbench/conf, Hydra's
search path), so a non-editable install runs from any directory; a user's own config
directory adds options beside fedbench's."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import fmnist_available

REPO = Path(__file__).resolve().parents[1]
TINY = ["rounds=1", "clients=6", "split.train_per_client=60", "model.hidden=[16]", "device=cpu"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """fedbench built as a wheel and installed (not editable) into a folder of its own."""
    tmp = tmp_path_factory.mktemp("pkg")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(tmp / "wheel"), str(REPO)], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip()[-300:]}")
    (wheel,) = (tmp / "wheel").glob("fedbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    yamls = sorted(str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml"))
    assert {f"fedbench/{y}" for y in yamls} <= set(names)
    assert any(n.startswith("fedbench/report/paper_tables/") for n in names)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp / "site"), str(wheel)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return tmp / "site"


def run_installed(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import fedbench.cli as c; print('CONF', c.CONF_DIR); c.main()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
@pytest.mark.long
def test_non_editable_install_runs_from_another_directory(installed, tmp_path):
    r = run_installed(installed, *TINY, "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"CONF {installed}" in r.stdout  # the packaged configs, not the checkout's
    assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
@pytest.mark.long
def test_a_users_config_directory_adds_options(installed, tmp_path):
    mine = tmp_path / "myconf" / "algo"
    mine.mkdir(parents=True)
    (mine / "fedavg_uniform.yaml").write_text("name: fedavg\nweighting: uniform\n")
    r = run_installed(installed, "--config-dir", str(tmp_path / "myconf"), "algo=fedavg_uniform",
                      *TINY, "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "weighting: uniform" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    r = run_installed(installed, "--config-dir", str(tmp_path / "myconf"), "algo=nope", *TINY,
                      cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "fedavg_uniform" in r.stderr  # listed among the options
