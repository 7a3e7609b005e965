"""`fedbench-report DIR --html page.html`: the self-contained results page.

The slow test trains a small sweep on real FMNIST (fedavg and local, 2 seeds), adds a job
that fails at run time (split.classes_per_client=12 of 10 classes: error.txt) and a run
without summary.json or error.txt (unfinished), writes the page and loads it in headless
Chromium (scripts/install_chromium.sh): the page loads without a console error, its cells
are the CSV report's numbers and the terminal report's texts, the failed run is listed
with its error, and the figures are embedded as data URIs.
"""

from __future__ import annotations

import base64
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import CLI_BACKEND, fmnist_available
from fedbench.report import cli
from fedbench.report.collect import find_runs
from fedbench.report.html import page, run_state
from fedbench.report.table import grid

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
SWEEP = [
    "-m",
    "algo=fedavg,local",
    "seed=0,1",
    "clients=6",
    "rounds=2",
    "split.train_per_client=60",
    "model.hidden=[16]",
    "device=cpu",
    "eval.every=1",
    CLI_BACKEND,
]
FAILING = ["-m", "algo=fedavg", "seed=0", "split.classes_per_client=12", *SWEEP[3:]]


# --------------------------------------------------------------------------- helpers
def fedbench(*args: str, cwd) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from fedbench.cli import main; main()", *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def report(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fedbench.report", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)


def chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile (nothing shared between runs)."""
    with tempfile.TemporaryDirectory(prefix="fedbench-chromium-") as profile:
        cmd = [
            str(CHROMIUM),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


class Dom(HTMLParser):
    """What the test reads from a page: the results table's cells (header and body rows),
    every <img> src, every src/href, the failed-runs list items, the header counts, the
    <html> attributes."""

    def __init__(self, text: str):
        super().__init__()
        self.html_attrs: dict[str, str] = {}
        self.heads: list[str] = []
        self.body: list[list[str]] = []
        self.imgs: list[str] = []
        self.links: list[str] = []  # every src= / href=
        self.items: list[str] = []  # <li> texts of the failed-runs section
        self.ids: dict[str, str] = {}  # text of <span id=...>
        self._table = self._cell = self._li = self._span = None
        self._section = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "html":
            self.html_attrs = {k: v or "" for k, v in attrs}
        for k in ("src", "href"):
            if a.get(k):
                self.links.append(a[k])
        if tag == "section":
            self._section = a.get("id")
        if tag == "table" and "results" in (a.get("class") or ""):
            self._table = True
        elif tag == "tr" and self._table:
            self.body.append([]) if self._in_body else None
        elif tag == "tbody" and self._table:
            self._in_body = True
        elif tag in ("td", "th") and self._table:
            self._cell = []
        elif tag == "img":
            self.imgs.append(a.get("src") or "")
        elif tag == "li" and self._section == "failed":
            self._li = []
        elif tag == "span" and a.get("id"):
            self._span = (a["id"], [])

    _in_body = False

    def handle_endtag(self, tag):
        if tag == "table" and self._table:
            self._table = None
            self._in_body = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell)
            (self.body[-1] if self._in_body else self.heads).append(text)
            self._cell = None
        elif tag == "li" and self._li is not None:
            self.items.append("".join(self._li))
            self._li = None
        elif tag == "span" and self._span is not None:
            self.ids[self._span[0]] = "".join(self._span[1])
            self._span = None

    def handle_data(self, data):
        for buf in (self._cell, self._li, self._span[1] if self._span else None):
            if buf is not None:
                buf.append(data)


def console_errors(stderr: str) -> list[str]:
    """Chromium's console messages (logged as INFO:CONSOLE whatever their level: the page
    itself logs nothing, so any is a failure) and uncaught exceptions."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def load(page_path: Path) -> tuple[Dom, str]:
    r = chromium("--dump-dom", page_path.resolve().as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "</html>" in r.stdout, r.stderr[-2000:]
    return Dom(r.stdout), r.stderr


def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


NUM = re.compile(r"^(-?\d+\.\d+)(?: ± (\d+\.\d+))?")


def check_cells_match_csv(dom: Dom, rows: list[dict], nlab: int, digits: int) -> None:
    """The page's cells, row by row, are the CSV's (row, column) lines in order: the same
    mean ± std (rounded to `digits`) and the same marks."""
    cells = [c for line in dom.body for c in line[nlab:]]
    assert len(cells) == len(rows), (cells, rows)
    tol = 0.5 * 10**-digits + 1e-9
    for text, row in zip(cells, rows):
        if row["status"] == "ok":
            m = NUM.match(text)
            assert m, text
            assert abs(float(m.group(1)) - float(row["mean"])) <= tol, (text, row)
            if row["std"]:
                assert m.group(2) and abs(float(m.group(2)) - float(row["std"])) <= tol
            else:
                assert m.group(2) is None, (text, row)
            assert len(m.group(1).split(".")[1]) == digits, text
        else:
            assert text == {"failed": "failed", "missing": "—", "n/a": "n/a"}[row["status"]]


# --------------------------------------------------------------------------- slow: real runs
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no /usr/bin/chromium (scripts/install_chromium.sh installs it)"
)
needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real sweep: fedavg and local x 2 seeds (finished), a job that failed at run time
    (error.txt) and a copy of a finished run without its summary.json (unfinished)."""
    base = tmp_path_factory.mktemp("html")
    out = base / "sweep"
    jobs = [
        fedbench(*SWEEP, f"hydra.sweep.dir={out}", cwd=base),
        fedbench(*FAILING, f"hydra.sweep.dir={out / 'failing'}", cwd=base),
    ]
    logs = [p.communicate(timeout=240)[0] for p in jobs]
    assert jobs[0].returncode == 0, logs[0][-3000:]
    assert jobs[1].returncode != 0, logs[1][-3000:]
    finished = sorted(p for p in out.iterdir() if (p / "summary.json").is_file())
    assert len(finished) == 4, logs[0][-3000:]
    killed = out / "killed"
    shutil.copytree(finished[0], killed)
    (killed / "summary.json").unlink()
    return out


@pytest.mark.slow
@needs_fmnist
@needs_chromium
def test_page_in_headless_chromium(sweep, tmp_path):
    html_path = tmp_path / "out" / "page.html"  # its folder is made
    r = report(str(sweep), "--html", str(html_path))
    assert r.returncode == 0, r.stderr
    assert f"wrote {html_path}" in r.stderr
    terminal = r.stdout
    table_csv = report(str(sweep), "--format", "csv")
    assert table_csv.returncode == 0, table_csv.stderr
    rows = csv_rows(table_csv.stdout)

    dom, log = load(html_path)
    # loaded, nothing failed: no script error or failed load (recorded in <html>), no
    # console message
    assert dom.html_attrs.get("data-errors") == "0", dom.html_attrs
    assert console_errors(log) == [], console_errors(log)

    # the header: 6 runs, 4 finished, the failing job failed, the copy unfinished
    assert dom.ids["n-runs"] == "6 runs"
    assert dom.ids["n-finished"] == "4 finished"
    assert dom.ids["n-failed"] == "1 failed"
    assert dom.ids["n-unfinished"] == "1 unfinished"

    # the table: the CSV's numbers, the terminal report's texts
    assert dom.heads[0] == "algo"
    assert [line[0] for line in dom.body] == ["fedavg", "local"]
    check_cells_match_csv(dom, rows, nlab=1, digits=2)
    for line in dom.body:
        for text in line:
            assert text in terminal, (text, terminal)
    assert any("(1 failed)" in c for c in dom.body[0])  # the copy without summary.json

    # the failed job with its error line, the copy as unfinished
    (failed_dir,) = (p for p in (sweep / "failing").iterdir() if p.is_dir() and "=" in p.name)
    error = (failed_dir / "error.txt").read_text().strip()
    assert "classes_per_client=12" in error
    failed = [li for li in dom.items if failed_dir.name in li]
    assert len(failed) == 1 and error in failed[0] and "failed" in failed[0], dom.items
    assert any(li.startswith("killed") and "unfinished" in li for li in dom.items), dom.items

    # what varied
    text = html_path.read_text()
    assert '<section id="varied">' in text
    for key, values in (("algo", "fedavg, local"), ("seed", "0, 1"),
                        ("split.classes_per_client", "2, 12")):  # fmt: skip
        assert re.search(rf"<code>{re.escape(key)}</code></td><td[^>]*>{re.escape(values)}<", text)

    # the figures: PNG data URIs; nothing loaded from elsewhere
    assert len(dom.imgs) >= 4, dom.imgs  # curves, clients, lsg, partition
    for src in dom.imgs:
        assert src.startswith("data:image/png;base64,"), src[:80]
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(link.startswith("data:") for link in dom.links), [x[:80] for x in dom.links]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", text)
    assert "@import" not in text and "url(" not in text

    # a screenshot (kept beside the page)
    shot = tmp_path / "page.png"
    r = chromium("--window-size=1280,2000", f"--screenshot={shot}", html_path.resolve().as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 30_000  # a blank 1280x2000 page is a few kB
    print(f"screenshot: {shot}")


@pytest.mark.slow
@needs_fmnist
@needs_chromium
def test_page_follows_table_options(sweep, tmp_path):
    """--rows/--cols/--metric/--digits/--reference/--select shape the page's table as the
    terminal's: the page's cells are `grid` of the table the CLI builds."""
    opts = [
        *("--metric", "personal.L.avg,personal.G.avg", "--cols", "", "--digits", "3"),
        *("--reference", "fedavg", "--select", "best", "--filter", "split.classes_per_client=2"),
    ]
    html_path = tmp_path / "page.html"
    r = report(str(sweep), *opts, "--html", str(html_path))
    assert r.returncode == 0, r.stderr
    dom, log = load(html_path)
    assert dom.html_attrs.get("data-errors") == "0" and console_errors(log) == []

    args = cli.parser().parse_args([str(sweep), *opts])
    runs = cli.apply_filters(find_runs(args.paths), args.filter)
    heads, body, nlab, _ = grid(cli.make_table(args, runs))
    assert dom.heads == [h[0] for h in heads]
    assert dom.body == body
    assert any("[" in c and "]" in c for line in body for c in line)  # --reference's interval
    assert re.match(r"^\d+\.\d{3} ± \d+\.\d{3}( |$)", body[0][nlab])  # 3 decimals
    rows = csv_rows(report(str(sweep), *opts, "--format", "csv").stdout)
    assert len(rows) == 4  # 2 algorithms x 2 metrics, one column
    for line, row in zip(body, rows):
        assert abs(float(NUM.match(line[nlab]).group(1)) - float(row["mean"])) <= 5e-4 + 1e-9
    # the runs that did not finish are on the page whatever the filter keeps
    assert dom.ids["n-runs"] == "5 runs" and dom.ids["n-unfinished"] == "1 unfinished"


@pytest.mark.slow
@needs_fmnist
def test_html_output_that_cannot_be_written(sweep, tmp_path):
    """One line on stderr, exit code 2, no file left behind."""
    for target, says in (
        ("/proc/fedbench-page.html", "cannot write /proc/fedbench-page.html"),
        (str(tmp_path), "is a directory"),
    ):
        r = report(str(sweep), "--html", target)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not list(Path("/proc").glob(".fedbench-page.html.*"))


# --------------------------------------------------------------------------- quick
def _run_dir(path: Path, error: str | None = None) -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text(
        "algo: {name: fedavg}\ndata: {name: fmnist}\nseed: 0\nclients: 4\n"
    )
    if error is not None:
        (path / "error.txt").write_text(error)
    return path


@pytest.mark.quick
def test_run_state_and_page_without_finished_runs(tmp_path):
    _run_dir(tmp_path / "a", "CUDA out of memory\nmore lines\n")
    _run_dir(tmp_path / "b")
    _run_dir(tmp_path / "c", "")
    runs = find_runs([tmp_path])
    assert [run_state(r) for r in runs] == [
        ("failed", "CUDA out of memory"),
        ("unfinished", "no summary.json and no error.txt (killed, or still running)"),
        ("failed", "(error.txt is empty)"),
    ]
    args = cli.parser().parse_args([str(tmp_path)])
    text = page(cli.make_table(args, runs), runs, [str(tmp_path)], command="fedbench-report x")
    assert "3 runs" in text and "0 finished" in text and "2 failed" in text
    assert "CUDA out of memory" in text and "more lines" not in text
    assert "No plots" in text and '<td class="num cell-failed">failed</td>' in text


@pytest.mark.quick
def test_page_escapes_error_text(tmp_path):
    _run_dir(tmp_path / "r", "<script>alert(1)</script> & more")
    runs = find_runs([tmp_path])
    args = cli.parser().parse_args([str(tmp_path)])
    text = page(cli.make_table(args, runs), runs, [str(tmp_path)])
    assert "<script>alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in text


@pytest.mark.quick
@pytest.mark.parametrize(
    "target, says",
    [
        ("{tmp}", "is a directory"),
        ("{tmp}/file/page.html", "is not a directory"),
    ],
)
def test_bad_html_path_is_one_line_and_exit_2(tmp_path, capsys, target, says):
    (tmp_path / "file").write_text("x")
    code = cli.main([str(tmp_path), "--html", target.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and says in err and err.startswith("fedbench-report: --html")
