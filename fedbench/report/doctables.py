"""Tables in the docs that cannot go stale.

Every paper table in README.md and docs/ is the output of one `fedbench-report` command on
a stated folder of `results/`, pasted between two markers that name the command:

    <!-- fedbench-report results/diversifed --preset diversifed_table1 --format markdown -->
    (the command's output)
    <!-- end -->

The algorithm tables (the README's, docs/README.md's rows) are generated the same way from
the algorithm registry and each class's `about` (fedbench/algorithms/_about.py), between

    <!-- fedbench-registry algorithms -->
    (the table)
    <!-- end -->

(`algorithms`, `not-yet`, `docs-index`: the keys of `_about.TABLES`).

`update(files)` runs every marked command (from the repository root) and rewrites what lies
between its markers; `stale(files)` lists the blocks whose text differs from what the command
prints today (tests/test_docs_tables.py fails on one, naming the file and the command;
`python scripts/update_docs_tables.py` rewrites them).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from fedbench.report.collect import ReportError

REPO = Path(__file__).resolve().parents[2]
BEGIN = re.compile(
    r"^<!-- (?P<tool>fedbench-report|fedbench-registry) (?P<args>.+?) -->[ \t]*$", re.M
)
REGISTRY = "fedbench-registry"
END = "<!-- end -->"


@dataclass(frozen=True)
class Block:
    """One marked table: the command's arguments and where its text lies in the file."""

    tool: str  # "fedbench-report" (a report on results/) or "fedbench-registry" (a table)
    path: Path
    line: int  # 1-based line of the begin marker
    args: tuple[str, ...]
    start: int  # offset just after the begin marker's line
    end: int  # offset of the end marker
    text: str  # what lies between the markers now

    @property
    def command(self) -> str:
        return shlex.join([self.tool, *self.args])


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The marked tables of a file, in order; a begin marker without its end is an error."""
    text = path.read_text(encoding="utf-8") if text is None else text
    out = []
    for m in BEGIN.finditer(text):
        start = m.end() + 1 if text[m.end() : m.end() + 1] == "\n" else m.end()
        end = text.find(END, start)
        nxt = BEGIN.search(text, start)
        line = text.count("\n", 0, m.start()) + 1
        if end < 0 or (nxt is not None and nxt.start() < end):
            raise ReportError(f"{path}:{line}: a fedbench-report marker without its {END}")
        args, tool = tuple(shlex.split(m.group("args"))), m.group("tool")
        if tool == REGISTRY:
            from fedbench.algorithms._about import TABLES

            if len(args) != 1 or args[0] not in TABLES:
                raise ReportError(
                    f"{path}:{line}: {REGISTRY} takes one of {', '.join(TABLES)}, not "
                    f"{m.group('args')!r}"
                )
        elif "--format" not in args or args[args.index("--format") + 1 :][:1] != ("markdown",):
            raise ReportError(f"{path}:{line}: a docs table needs --format markdown")
        out.append(Block(tool, path, line, args, start, end, text[start:end]))
    return out


def output(args: tuple[str, ...], root: Path = REPO) -> str:
    """What `fedbench-report ARGS` prints, run from `root`, as it sits between the markers
    (a blank line before and after)."""
    from fedbench.report import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    if code != 0:
        why = err.getvalue().strip().splitlines()
        raise ReportError(
            f"{shlex.join(['fedbench-report', *args])} exited {code}: {why[-1] if why else ''}"
        )
    return "\n" + out.getvalue().rstrip("\n") + "\n\n"


def docs_files(root: Path = REPO) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def registry_output(name: str, page: Path) -> str:
    """Table `name` of fedbench/algorithms/_about.py for the registered algorithms, with its
    links relative to `page`, as it sits between the markers."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.algorithms._about import TABLES

    algos = {n: ALGORITHMS.get(n) for n in ALGORITHMS.names()}
    try:
        table = TABLES[name](algos, page)
    except ValueError as e:  # an algorithm's `about` is wrong: one line naming it
        raise ReportError(f"{REGISTRY} {name}: {e}") from None
    return "\n" + table.rstrip("\n") + "\n\n"


def fresh_text(b: Block, root: Path = REPO) -> str:
    """What block `b` should hold today."""
    if b.tool == REGISTRY:
        return registry_output(b.args[0], b.path)
    return output(b.args, root)


def stale(files: list[Path], root: Path = REPO, tool: str | None = None) -> list[tuple[Block, str]]:
    """(block, what the command prints today) for every block (of `tool`, or all) whose text
    differs."""
    out = []
    for path in files:
        for b in blocks(path):
            if tool is not None and b.tool != tool:
                continue
            fresh = fresh_text(b, root)
            if fresh != b.text:
                out.append((b, fresh))
    return out


def update(files: list[Path], root: Path = REPO) -> list[Block]:
    """Rewrite every stale block in place; the blocks rewritten."""
    from fedbench.io import atomic_write_text

    changed = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        found = blocks(path, text)
        new, last = [], 0
        for b in found:
            fresh = fresh_text(b, root)
            new += [text[last : b.start], fresh]
            last = b.end
            if fresh != b.text:
                changed.append(b)
        new.append(text[last:])
        result = "".join(new)
        if result != text:
            atomic_write_text(path, result)
    return changed
