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
