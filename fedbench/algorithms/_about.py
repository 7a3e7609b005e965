"""What the documentation says about each algorithm, declared once beside its code.

Every registered class carries `about = About(...)`: its display name, its paper, one line on
what it is, its section in docs/ (or None: its module docstring is its documentation) and its
name among PFLlib's and FL-bench's methods (fedbench/algorithms/_libraries.py). The README's
algorithm table, its list of the other libraries' methods we do not yet have, and the
algorithm rows of docs/README.md are generated from these (`TABLES`), between markers

    <!-- fedbench-registry algorithms -->
    (generated)
    <!-- end -->

by `python scripts/update_docs_tables.py` (fedbench/report/doctables.py); tests/test_docs_tables.py
fails, naming that command, when one is stale. So a new algorithm brings its own rows: its
contributor edits no existing file, and the script rewrites the generated blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedbench.algorithms._libraries import (
    FL_BENCH,
    FL_BENCH_COMMIT,
    PFLLIB,
    PFLLIB_COMMIT,
    SERVER_OPTIMIZERS,
)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class About:
    """One algorithm's row in the docs. `summary` is one line of Markdown (plain `|`, escaped
    when it lands in a table); `docs` is a path under docs/ with its section's anchor
    ("papers/plgu.md#fedsam-fedsam"), None when the module docstring is the documentation;
    `pfllib` / `fl_bench` name the method in that library's list (a key of PFLLIB /
    FL_BENCH), None when it lacks it."""

    name: str
    paper: str
    summary: str
    docs: str | None = None
    pfllib: str | None = None
    fl_bench: str | None = None

    def problems(self) -> list[str]:
        """What is wrong with this declaration (checked when the docs tables are made, not at
        import: a typo here must not stop a run)."""
        out = []
        for lib, known in (("pfllib", PFLLIB), ("fl_bench", FL_BENCH)):
            got = getattr(self, lib)
            if got is not None and got not in known:
                out.append(
                    f"{lib}={got!r} is not in its list (fedbench/algorithms/_libraries.py): "
                    + ", ".join(sorted(known))
                )
        if self.docs is not None and not (REPO / "docs" / self.docs.split("#")[0]).is_file():
            out.append(f"docs={self.docs!r}: no such page under docs/")
        return out

    @property
    def family(self) -> str:
        """The docs page it belongs to ("papers/plgu.md", "algorithms.md"), or "module"."""
        return self.docs.split("#")[0] if self.docs else "module"


def about_of(name: str, cls: type) -> About:
    about = getattr(cls, "about", None)
    if not isinstance(about, About):
        raise ValueError(
            f"algorithm {name!r} ({cls.__module__}.{cls.__qualname__}) declares no "
            "`about = About(...)` (fedbench/algorithms/_about.py; CONTRIBUTING.md)"
        )
    wrong = about.problems()
    if wrong:
        raise ValueError(f"algorithm {name!r}: About: {'; '.join(wrong)}")
    return about


def module_path(cls: type) -> Path:
    return REPO / (cls.__module__.replace(".", "/") + ".py")


def _link(target: Path, anchor: str, page: Path) -> str:
    rel = os.path.relpath(target, page.parent).replace(os.sep, "/")
    return f"{rel}#{anchor}" if anchor else rel


def doc_link(name: str, cls: type, page: Path) -> str:
    """The link, relative to `page`, to the algorithm's docs section or its module."""
    about = about_of(name, cls)
    if about.docs is None:
        return _link(module_path(cls), "", page)
    path, _, anchor = about.docs.partition("#")
    return _link(REPO / "docs" / path, anchor, page)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def algorithm_table(algos: Mapping[str, type], page: Path) -> str:
    """The README's table: every registered algorithm, its paper, what it is, and whether
    PFLlib and FL-bench have it."""
    rows = [
        "| `algo=` | method | paper | what it is | PFLlib | FL-bench |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, cls in sorted(algos.items()):
        a = about_of(name, cls)
        rows.append(
            f"| `{name}` | [{a.name}]({doc_link(name, cls, page)}) | {_cell(a.paper)} "
            f"| {_cell(a.summary)} | {'✓' if a.pfllib else '—'} | {'✓' if a.fl_bench else '—'} |"
        )
    server = _link(REPO / "docs" / "algorithms.md", "server-optimizers-server_opt", page)
    for option, method, paper, pfl, flb in SERVER_OPTIMIZERS:
        rows.append(
            f"| `{_cell(option)}` | [{method}]({server}) | {paper} | the server's step on the "
            f"clients' average | {'✓' if pfl else '—'} | {'✓' if flb else '—'} |"
        )
    return "\n".join(rows)


def not_yet(algos: Mapping[str, type], page: Path) -> str:
    """The other libraries' methods that no algorithm of ours names."""
    ours = [about_of(n, c) for n, c in algos.items()]
    lines = []
    for lib, known, commit, attr, extra in (
        ("PFLlib", PFLLIB, PFLLIB_COMMIT, "pfllib", {s[3] for s in SERVER_OPTIMIZERS}),
        ("FL-bench", FL_BENCH, FL_BENCH_COMMIT, "fl_bench", {s[4] for s in SERVER_OPTIMIZERS}),
    ):
        have = {getattr(a, attr) for a in ours} | extra
        missing = sorted((m for m in known if m not in have), key=str.lower)
        lines.append(
            f"- {lib} (its server modules at commit `{commit[:7]}`): "
            + (", ".join(missing) if missing else "none")
        )
    return "\n".join(lines)


def docs_index(algos: Mapping[str, type], page: Path) -> str:
    """docs/README.md's rows: every algorithm and the page that documents it."""
    rows = ["| `algo=` | method | page |", "| --- | --- | --- |"]
    for name, cls in sorted(algos.items()):
        a = about_of(name, cls)
        where = a.family if a.docs else f"{cls.__module__.rsplit('.', 1)[1]}.py, its docstring"
        rows.append(f"| `{name}` | {a.name} | [{where}]({doc_link(name, cls, page)}) |")
    return "\n".join(rows)


# name in the marker -> generator(registered algorithms, the page it lands in)
TABLES: dict[str, Callable[[Mapping[str, type], Path], str]] = {
    "algorithms": algorithm_table,
    "not-yet": not_yet,
    "docs-index": docs_index,
}
