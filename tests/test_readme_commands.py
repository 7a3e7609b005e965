"""scripts/readme_commands.py, which hands CI (.ci/run) the README's set-up and test commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from readme_commands import ReadmeError, readme_command  # noqa: E402

sys.path.pop(0)

DOC = """# Title

## Set up and run (fresh Debian)

Text with `inline` code.

```python
print("not a command")
```

```bash
python3 -m venv ~/.venvs/x && pip install -e ".[dev]"
```

### A subsection

````text
## not a heading: inside a fence
```bash
nor is this a block
```
````

## Run the tests

```bash
pytest -q
```

## Two

```bash
a
```

```bash
b
```

## None

No command here.

## Open

```bash
never closed
"""


@pytest.mark.quick
def test_the_readme_holds_both_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    setup = readme_command(text, "Set up and run")
    assert "python3 -m venv ~/.venvs/fedbench" in setup and 'pip install -e ".[dev]"' in setup
    assert setup.endswith("fedbench")  # the default run, as a new user sees it
    tests = readme_command(text, "Run the tests")
    assert ". ~/.venvs/fedbench/bin/activate" in tests and "pytest" in tests


@pytest.mark.quick
def test_sections_blocks_and_fences_are_read_precisely():
    setup = readme_command(DOC, "Set up and run")
    assert setup == 'python3 -m venv ~/.venvs/x && pip install -e ".[dev]"'
    assert readme_command(DOC, "Run the tests") == "pytest -q"


@pytest.mark.quick
@pytest.mark.parametrize(
    "heading, words",
    [
        ("Two", "holds 2 ```bash blocks"),
        ("None", "holds 0 ```bash blocks"),
        ("Open", "never closed"),
        ("Missing", "no '## Missing' section"),
        ("A subsection", "no '## A subsection' section"),  # a level-3 heading is no section
    ],
)
def test_anything_but_one_block_is_an_error(heading, words):
    with pytest.raises(ReadmeError, match=words.replace("*", r"\*")):
        readme_command(DOC, heading)


@pytest.mark.quick
def test_the_script_prints_the_command_or_one_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(DOC)
    script = [sys.executable, str(REPO / "scripts" / "readme_commands.py")]
    r = subprocess.run([*script, "Run the tests", str(readme)], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, "pytest -q\n", "")
    r = subprocess.run([*script, "Two", str(readme)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("readme_commands: ") and r.stderr.count("\n") == 1


INNER = """
import pytest

@pytest.mark.quick
@pytest.mark.xdist_group("g")
def test_grouped():
    pytest.skip("needs x: pip install 'fedbench[x]'")

@pytest.mark.quick
@pytest.mark.parametrize("p", ["a@b"])
def test_param(p):
    pytest.skip("why")

@pytest.mark.quick
def test_runs():
    pass
"""


@pytest.mark.slow
@pytest.mark.long
def test_skipped_tests_are_recorded_as_ids_pytest_takes_back(tmp_path):
    """.ci/run's second half runs again the ids that tests/conftest.py recorded in the first
    (under xdist's loadgroup, whose "@group" suffix is no part of an id pytest takes)."""
    import json
    import os

    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(INNER)
    out = tmp_path / "skipped.jsonl"
    env = {**os.environ, "FEDBENCH_SKIPPED_TO": str(out)}
    pytest_ = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    r = subprocess.run([*pytest_, "-n", "1", "--dist", "loadgroup", "test_inner.py"], **run)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=str)
    assert rows == [
        {"nodeid": "test_inner.py::test_grouped", "reason": "needs x: pip install 'fedbench[x]'"},
        {"nodeid": "test_inner.py::test_param[a@b]", "reason": "why"},
    ]
    r = subprocess.run([*pytest_, "-n", "0", "--co", *(row["nodeid"] for row in rows)], **run)
    assert r.returncode == 0 and "2 tests collected" in r.stdout, r.stdout + r.stderr
