"""`fedbench-report DIR --html page.html`: one self-contained results page.

The page holds, for the runs the report read (after --filter): a header (the directories,
how many runs, finished / failed / unfinished), the table exactly as the terminal report
prints it (the same cell texts: `fedbench.report.table.grid`, so --rows, --cols, --metric,
--select, --preset, --best-of, --reference and --digits apply as they do there), its
legend and notes, the config keys that vary between the runs and their values, the
figures of `fedbench.report.plots` embedded as base64 PNG data URIs, the reproduction card
of every finished run (`fedbench.report.cards`: its one-line command, wall time, machine,
code and data, the paper tables it lands in with the paper's number and the difference, the
reason for a gap of more than 2 points), and the runs that did not finish, each with its
one-line error (error.txt) or why it has none.

Nothing is loaded from elsewhere: the CSS is inline, the images are data URIs, and the one
inline script only records errors (into the `data-errors` attribute of <html>) so that a
headless browser's dumped DOM shows whether the page loaded cleanly.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
from collections.abc import Iterable
from pathlib import Path

from fedbench.report.cards import GAP, Card
from fedbench.report.collect import RunDir, format_value, hashable, sort_key, varying_keys
from fedbench.report.table import Table, grid, legend_lines

ERROR_FILE = "error.txt"  # fedbench.runner.ERROR_FILE (not imported: it needs torch)
MAX_ERROR_CHARS = 2000  # of error.txt's first line shown

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
       margin: 1.5em 2em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
code, .path { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.9em; }
.counts span { margin-right: 1.2em; }
.finished { color: #1a7f37; } .failed { color: #cf222e; } .unfinished { color: #9a6700; }
table { border-collapse: collapse; margin: 0.6em 0; }
caption { caption-side: top; text-align: left; font-weight: 600; padding-bottom: 0.3em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #e5e5e5; white-space: nowrap; }
th { background: #f6f8fa; text-align: center; }
td.label { text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.paper { color: #666; font-style: italic; }
tr.group-start td { border-top: 2px solid #ccc; }
td.cell-failed { color: #cf222e; } td.cell-missing, td.cell-na { color: #999; }
.notes { font-size: 0.9em; color: #444; white-space: pre-wrap; margin: 0.3em 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
ul.runs li { margin-bottom: 0.3em; } .err { color: #cf222e; }
details.card { margin: 0.4em 0; } details.card summary { cursor: pointer; }
details.card pre { background: #f6f8fa; padding: 0.5em; white-space: pre-wrap;
                   word-break: break-all; }
.gap { color: #9a6700; } .noreason { color: #cf222e; }
"""

# Records script errors and resources that fail to load (capture phase: <img> errors do
# not bubble) in <html data-errors="N" data-error-list="...">.
SCRIPT = """
(function () {
  var root = document.documentElement, list = [];
  root.setAttribute("data-errors", "0");
  window.addEventListener("error", function (e) {
    var t = e.target, what = (t && t !== window && (t.src || t.href))
      ? "failed to load " + (t.src || t.href).slice(0, 200) : String(e.message);
    list.push(what);
    root.setAttribute("data-errors", String(list.length));
    root.setAttribute("data-error-list", list.join(" | "));
  }, true);
})();
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def run_state(run: RunDir) -> tuple[str, str]:
    """('finished' | 'failed' | 'unfinished', why): failed = error.txt (its first line) or
    unreadable files; unfinished = neither summary.json nor error.txt (killed, or still
    running)."""
    if not run.failed:
        return "finished", ""
    if run.unreadable:
        return "failed", "unreadable files: " + "; ".join(run.problems)
    err = Path(run.path) / ERROR_FILE
    try:
        text = err.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "unfinished", "no summary.json and no error.txt (killed, or still running)"
    except OSError as e:
        return "failed", f"error.txt cannot be read ({e.strerror or e})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else "(error.txt is empty)"
    if len(line) > MAX_ERROR_CHARS:
        line = line[:MAX_ERROR_CHARS] + " …"
    return "failed", line


def _shown_path(run: RunDir, roots: list[Path]) -> str:
    path = Path(run.path)
    for root in roots:
        try:
            rel = path.resolve().relative_to(root.resolve())
        except (ValueError, OSError):
            continue
        return str(rel) if str(rel) != "." else str(path)
    return str(path)


def varied(runs: list[RunDir]) -> list[tuple[str, list[str]]]:
    """[(key, its values)] for the config keys with more than one value (as `--keys`
    lists them), seed last when it has several."""
    out = []
    for k in [*varying_keys(runs), "seed"]:
        values = sorted({hashable(r.get(k)) for r in runs}, key=sort_key)
        if len(values) > 1:
            out.append((k, [format_value(v) for v in values]))
    return out


# --------------------------------------------------------------------------- sections
def table_html(table: Table) -> str:
    """The table as the terminal report lays it out: the same cell texts (`grid`)."""
    heads, body, nlab, span = grid(table)
    multi = len(table.stats) > 1
    out = ['<table class="results">', f"<caption>{_e(table.title)}</caption>", "<thead>"]
    if span > 1:  # (column, ours / paper) pairs under one header
        top = [f'<th rowspan="2" scope="col">{_e(h[0])}</th>' for h in heads[:nlab]]
        for k in range(nlab, len(heads), span):
            top.append(f'<th colspan="{span}" scope="colgroup">{_e(heads[k][0])}</th>')
        sub = [f'<th scope="col">{_e(h[1])}</th>' for h in heads[nlab:]]
        out += ["<tr>" + "".join(top) + "</tr>", "<tr>" + "".join(sub) + "</tr>"]
    else:
        out.append("<tr>" + "".join(f'<th scope="col">{_e(h[0])}</th>' for h in heads) + "</tr>")
    out += ["</thead>", "<tbody>"]
    marks = {"—": "cell-missing", "failed": "cell-failed", "n/a": "cell-na"}
    for n, line in enumerate(body):
        start = multi and n and n % len(table.stats) == 0
        tds = []
        for k, text in enumerate(line):
            if k < nlab:
                cls = "label"
            else:
                cls = "num"
                if span > 1 and (k - nlab) % span == 1:
                    cls += " paper"
                if text in marks:
                    cls += " " + marks[text]
            tds.append(f'<td class="{cls}">{_e(text)}</td>')
        tr = '<tr class="group-start">' if start else "<tr>"
        out.append(tr + "".join(tds) + "</tr>")
    out += ["</tbody>", "</table>"]
    notes = [*legend_lines(table), *table.notes]
    out.append('<div class="notes">' + "\n".join(_e(n) for n in notes) + "</div>")
    return "\n".join(out)


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def card_html(card: Card) -> str:
    """One run's reproduction card, folded (<details>): the same facts as its card.md."""
    gap = ""
    if card.max_gap is not None:
        cls = "gap" if card.needs_reason else ""
        gap = f' <span class="{cls}">(max gap to the paper {card.max_gap:.2f} points)</span>'
    facts = [
        ("run", f"algo={card.algo} on {card.data}, seed {card.seed}, {card.rounds} rounds"),
        ("wall time", "not recorded" if card.wall_time_s is None
         else f"{card.wall_time_s / 60:.1f} min ({card.wall_time_s:.0f} s)"),
        ("machine", card.machine),
        ("fedbench", f"version {card.version}; commit {card.commit}"),
        ("torch", card.torch),
        ("data digest", f"{card.data_digest}: {card.data_digest_note}"),
        ("pinned", card.pin.replace("`", "")),
    ]  # fmt: skip
    if card.note:
        facts.append(("note", card.note))
    out = [
        f'<details class="card"><summary><code class="path">{_e(card.cell)}</code>{gap}</summary>',
        f"<pre><code>{_e(card.command)}</code></pre>",
        '<table class="card"><tbody>',
        *(f'<tr><th scope="row">{_e(k)}</th><td class="label">{_e(v)}</td></tr>' for k, v in facts),
        "</tbody></table>",
    ]
    for c in card.comparisons:
        when = "best round" if c.select == "best" else "last evaluation"
        at = f", round {c.round}" if c.round is not None else ""
        out.append(
            '<table class="card-paper"><caption>'
            f"{_e(c.title)} [{_e(c.preset)}]: {_e(c.row)} / {_e(c.column)} ({when}{at})"
            "</caption><thead><tr><th>stat</th><th>ours</th><th>paper</th>"
            "<th>ours − paper</th></tr></thead><tbody>"
        )
        for s in c.stats:
            out.append(
                f'<tr><td class="label">{_e(s.stat)}</td><td class="num">{_num(s.ours)}</td>'
                f'<td class="num paper">{_e(s.paper or "—")}</td>'
                f'<td class="num">{_num(s.difference, "+.2f")}</td></tr>'
            )
        out.append("</tbody></table>")
        out += [f'<p class="notes">{_e(d)}</p>' for d in c.deviations]
    if card.needs_reason or card.reason:
        if card.reason:
            head = f"Why more than {GAP:g} points from the paper" if card.needs_reason else "Note"
            out.append(f"<p><strong>{head}:</strong> {_e(card.reason)}</p>")
        else:
            out.append('<p class="noreason">No reason given for a gap of more than '
                       f"{GAP:g} points.</p>")  # fmt: skip
        if card.checks:
            out.append(
                "<p>Checked by: "
                + ", ".join(f'<code class="path">{_e(c)}</code>' for c in card.checks)
                + "</p>"
            )
    out.append("</details>")
    return "\n".join(out)


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = path.stem
    return (
        f'<figure id="fig-{_e(name)}"><img alt="{_e(name)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{_e(path.name)}</figcaption></figure>'
    )


def page(
    table: Table,
    runs: list[RunDir],
    paths: Iterable[str],
    plots: Iterable[Path] = (),
    command: str | None = None,
    cards: Iterable[Card] = (),
) -> str:
    """The whole page as text (UTF-8 HTML5). `runs`: every run read (after --filter);
    `plots`: PNG files to embed (what `write_plots` wrote); `cards`: the finished runs'
    reproduction cards."""
    paths = [str(p) for p in paths]
    roots = [Path(p) for p in paths]
    states = [(r, *run_state(r)) for r in runs]
    count = {
        s: sum(1 for _, st, _ in states if st == s) for s in ("finished", "failed", "unfinished")
    }
    where = ", ".join(paths)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>fedbench results: {_e(where)}</title>",
        f"<script>{SCRIPT}</script>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body>",
        '<header id="header">',
        "<h1>fedbench results</h1>",
        '<p class="dirs">'
        + ", ".join(f'<code class="path">{_e(os.path.abspath(p))}</code>' for p in paths)
        + "</p>",
        '<p class="counts">'
        f'<span id="n-runs">{len(runs)} run{"s" if len(runs) != 1 else ""}</span>'
        f'<span id="n-finished" class="finished">{count["finished"]} finished</span>'
        f'<span id="n-failed" class="failed">{count["failed"]} failed</span>'
        f'<span id="n-unfinished" class="unfinished">{count["unfinished"]} unfinished</span>'
        "</p>",
    ]
    if command:
        parts.append(f'<p class="notes">made by <code>{_e(command)}</code> on {_e(stamp)}</p>')
    parts += ["</header>", '<section id="table">', "<h2>Results</h2>", table_html(table)]
    parts += [table_html(t) for t in table.sections]
    parts += ["</section>", '<section id="varied">', "<h2>What varied across runs</h2>"]
    keys = varied(runs)
    if keys:
        parts.append(
            '<table class="varied"><thead><tr><th>key</th><th>values</th></tr></thead><tbody>'
        )
        parts += [
            f'<tr><td class="label"><code>{_e(k)}</code></td>'
            f'<td class="label">{_e(", ".join(v))}</td></tr>'
            for k, v in keys
        ]
        parts.append("</tbody></table>")
    else:
        parts.append("<p>Nothing: every run has the same configuration.</p>")
    parts += ["</section>", '<section id="plots">', "<h2>Plots</h2>"]
    figs = [_figure(Path(p)) for p in plots]
    parts += figs or ["<p>No plots (no finished run with metrics).</p>"]
    parts += ["</section>", '<section id="cards">', "<h2>Reproduction cards</h2>"]
    cards = list(cards)
    if cards:
        parts.append(
            '<p class="notes">One per finished run: the command that makes it again, where '
            "and by what it was made, and the paper tables it lands in.</p>"
        )
        parts += [card_html(c) for c in cards]
    else:
        parts.append("<p>None (no finished run).</p>")
    parts += ["</section>", '<section id="failed">', "<h2>Runs that did not finish</h2>"]
    bad = [(r, st, why) for r, st, why in states if st != "finished"]
    if bad:
        parts.append('<ul class="runs">')
        for r, st, why in bad:
            parts.append(
                f'<li class="{st}"><code class="path">{_e(_shown_path(r, roots))}</code>: '
                f'<strong>{st}</strong> — <span class="err">{_e(why)}</span></li>'
            )
        parts.append("</ul>")
    else:
        parts.append("<p>None: every run finished.</p>")
    parts += ["</section>", "</body>", "</html>", ""]
    return "\n".join(parts)
