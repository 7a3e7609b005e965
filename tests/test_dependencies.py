"""Every third-party package the code imports is one its installation brings.

The README's test command failed twice on a fresh machine while CI passed: a test imported a
package (scipy) that only an optional extra brought, transitively, and CI installed every
extra. These tests read the imports of fedbench/, scripts/ and tests/ (statically, so they
hold whatever this environment has installed) against pyproject.toml:
- fedbench/ imports its core `dependencies` freely; anything else only inside a function
  (so that `import fedbench.x` works without it) and either within try/except ImportError,
  or named in fedbench's own tables of optional modules (tracking.EXTRAS, cli.LAUNCHERS,
  cli.SWEEPERS), which are checked with one line naming the extra before a run starts;
- scripts/ and tests/ may also import what the README's set-up installs (the extras that
  its `pip install -e ".[...]"` names); tests/ get any other package through
  conftest.needs(module, extra), which skips naming the extra, and never by an import.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

from conftest import needs

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"fedbench", "conftest"} | {
    p.stem for d in ("tests", "scripts") for p in (REPO / d).glob("*.py")
}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def req_name(req: str) -> str:
    return norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the dev extra brings tomli
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def readme_extras() -> list[str]:
    """The extras the README's set-up command installs (`pip install -e ".[dev]"`)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from readme_commands import readme_command
    finally:
        sys.path.pop(0)
    setup = readme_command((REPO / "README.md").read_text(encoding="utf-8"), "Set up and run")
    m = re.search(r"""pip install -e ["']?\.\[([\w,-]+)\]""", setup)
    assert m, f'no `pip install -e ".[...]"` in the README\'s set-up: {setup}'
    return m.group(1).split(",")


def allowed(extras: list[str]) -> set[str]:
    """Distributions the core dependencies and these extras name directly."""
    project = pyproject()
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project["optional-dependencies"][e]
    return {req_name(r) for r in reqs}


class Import:
    def __init__(self, module: str, where: str, guarded: bool, lazy: bool) -> None:
        self.module, self.where, self.guarded, self.lazy = module, where, guarded, lazy
        self.top = module.split(".")[0]


def _catches_import_error(node: ast.Try) -> bool:
    for h in node.handlers:
        types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(isinstance(t, ast.Name) and t.id in IMPORT_ERRORS for t in types):
            return True
    return False


def third_party_imports(path: Path) -> list[Import]:
    """The absolute imports of `path` that are neither the standard library nor ours, each
    with whether a try/except ImportError guards it and whether a function holds it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[Import] = []

    def visit(node: ast.AST, guarded: bool, lazy: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if isinstance(node, ast.ImportFrom) and node.level:
                names = []  # relative: ours
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    out.append(Import(name, where, guarded, lazy))
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                visit(child, True, lazy)
            for child in (*node.handlers, *node.orelse, *node.finalbody):
                visit(child, guarded, lazy)
            return
        in_fn = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded, in_fn)

    visit(tree, False, False)
    return out


@functools.cache
def top_level_owners() -> dict[str, list[str]]:
    return md.packages_distributions()  # seconds: it reads every installed distribution


@functools.cache
def owners(module: str) -> frozenset[str] | None:
    """The installed distributions that provide `module` (None: not installed here)."""
    top = module.split(".")[0]
    dists = top_level_owners().get(top)
    if not dists:
        return None
    if len(dists) > 1:  # a namespace package (hydra_plugins): the one holding the module
        stem = module.replace(".", "/")
        held = {
            d
            for d in dists
            if any(str(f).startswith((stem + "/", stem + ".py")) for f in md.files(d) or ())
        }
        dists = sorted(held) or dists
    return frozenset(norm(d) for d in dists)


def files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def provided(imp: Import, ok: set[str]) -> bool:
    """Whether a distribution in `ok` provides the import (one not installed here: by its
    name, as tomli for Python 3.10)."""
    have = owners(imp.module)
    return bool(have & ok) if have is not None else norm(imp.top) in ok


def unguarded_misses(imports: list[Import], ok: set[str]) -> list[str]:
    bad = []
    for imp in imports:
        if imp.guarded or provided(imp, ok):
            continue
        have = owners(imp.module)
        why = f"comes from {sorted(have)}" if have else "is not installed here"
        bad.append(f"{imp.where}: {imp.module} {why}")
    return bad


@pytest.mark.quick
def test_the_package_imports_only_core_dependencies_unguarded():
    from fedbench import tracking
    from fedbench.cli import LAUNCHERS, SWEEPERS

    declared = {m.split(".")[0] for m, _ in tracking.EXTRAS.values()}
    declared |= {m.split(".")[0] for m, _ in (*LAUNCHERS.values(), *SWEEPERS.values())}
    extras = pyproject()["optional-dependencies"]
    for module, extra in (*tracking.EXTRAS.values(), *LAUNCHERS.values(), *SWEEPERS.values()):
        assert extra in extras, f"{module}'s extra {extra!r} is not in pyproject.toml"

    core = allowed([])
    imports = [i for p in files("fedbench") for i in third_party_imports(p)]
    bad = []
    for imp in imports:
        if imp.guarded or provided(imp, core):
            continue
        guarded_in_file = any(
            o.guarded and o.top == imp.top and o.where.split(":")[0] == imp.where.split(":")[0]
            for o in imports
        )
        if imp.lazy and (imp.top in declared or guarded_in_file):
            continue
        bad.append(f"{imp.where}: {imp.module}")
    assert not bad, (
        "fedbench imports packages that are not core dependencies (pyproject's "
        "`dependencies`), outside a function or without a guard: " + "; ".join(bad)
    )


@pytest.mark.quick
def test_scripts_and_tests_import_only_what_the_readme_installs():
    """The README's set-up installs the core dependencies and the extras it names: what
    else the tests use they get through conftest.needs, which skips naming the extra."""
    ok = allowed(readme_extras())
    imports = [i for p in files("tests", "scripts") for i in third_party_imports(p)]
    bad = unguarded_misses(imports, ok)
    assert not bad, (
        "imported without conftest.needs(module, extra), but the README's set-up does not "
        "install it (add it to pyproject's dev extra, or get it through needs): " + "; ".join(bad)
    )


def _requires(dist: str, seen: set[str]) -> set[str]:
    """`dist` and what it requires, transitively (as installed here; extras' own aside)."""
    if norm(dist) in seen:
        return seen
    seen.add(norm(dist))
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return seen
    for r in reqs:
        if "extra ==" not in r.replace('"', "").replace("'", ""):
            _requires(req_name(r), seen)
    return seen


def needs_calls() -> list[tuple[str, str, str]]:
    """(module, extra, where) of every conftest.needs / missing call with literal arguments,
    one per (module, extra), where: its first call."""
    out: dict[tuple[str, str], str] = {}
    for p in files("tests"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("needs", "missing")
                and len(node.args) == 2
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
            ):
                key = (node.args[0].value, node.args[1].value)
                out.setdefault(key, f"{p.relative_to(REPO)}:{node.lineno}")
    return [(module, extra, where) for (module, extra), where in sorted(out.items())]


NEEDS = needs_calls()


@pytest.mark.quick
def test_the_needs_calls_are_found():
    assert len(NEEDS) >= 5  # tracking's three readers, the launchers, the sweeper


@pytest.mark.quick
@pytest.mark.parametrize("module, extra, where", NEEDS, ids=[f"{m}-{e}" for m, e, _ in NEEDS])
def test_needs_names_the_extra_that_brings_the_module(module, extra, where):
    """Each needs(module, extra): the extra exists, the README's set-up does not bring the
    module already, and the extra does (directly or through what it requires). Without the
    module this skips like the tests that need it, so CI's second half checks it."""
    extras = pyproject()["optional-dependencies"]
    assert extra in extras, f"{where}: no extra {extra!r} in pyproject.toml"
    readme = allowed(readme_extras())
    assert not provided(Import(module, where, False, True), readme), (
        f"{where}: {module} comes with the README's set-up: import it"
    )
    needs(module, extra)
    closure: set[str] = set()
    for r in extras[extra]:
        _requires(req_name(r), closure)
    assert owners(module) & closure, f"{where}: {module} does not come with [{extra}]"


@pytest.mark.quick
def test_the_checker_sees_guards_and_functions(tmp_path, monkeypatch):
    src = tmp_path / "m.py"
    src.write_text(
        "import numpy\n"
        "import os, json\n"
        "from . import sibling\n"
        "try:\n"
        "    import nopkg_a\n"
        "except ImportError:\n"
        "    nopkg_a = None\n"
        "def f():\n"
        "    import nopkg_b.sub\n"
        "    try:\n"
        "        from nopkg_c import x\n"
        "    except (ValueError, ModuleNotFoundError):\n"
        "        import nopkg_d\n"
        "g = lambda: __import__('nopkg_e')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = third_party_imports(src)
    assert [(i.module, i.guarded, i.lazy) for i in found] == [
        ("numpy", False, False),
        ("nopkg_a", True, False),
        ("nopkg_b.sub", False, True),
        ("nopkg_c", True, True),
        ("nopkg_d", False, True),
    ]
    assert unguarded_misses(found, {"numpy", "nopkg-d"}) == [
        "m.py:9: nopkg_b.sub is not installed here"
    ]
    assert unguarded_misses(found, set()) == [
        "m.py:1: numpy comes from ['numpy']",
        "m.py:9: nopkg_b.sub is not installed here",
        "m.py:13: nopkg_d is not installed here",
    ]
