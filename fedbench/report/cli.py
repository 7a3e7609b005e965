"""`fedbench-report PATH...` (or `python -m fedbench.report`): tables and plots from run
and Hydra multirun directories. Bad input, and an output that cannot be written (read-only
folder, full disk, closed pipe), is one line on stderr and exit code 2; a run directory
with unreadable files is a warning line and a run counted as failed; a bug is one line
(the traceback in a file) and exit code 1. Never a traceback on the terminal."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace
from pathlib import Path

from fedbench.report import presets
from fedbench.report.collect import (
    ALIASES,
    METRIC_HELP,
    ReportError,
    RunDir,
    check_metric,
    default_select,
    find_runs,
    follows,
    format_value,
    hashable,
    parse_value,
    same_value,
    sort_key,
    varying_keys,
    write_output,
)
from fedbench.report.compare import (
    DEFAULT_BEST_BY,
    VAL_BEST_BY,
    BestOf,
    compare_to,
    default_best_by,
)
from fedbench.report.table import (
    EXTENSION,
    FORMATS,
    MAX_DIGITS,
    SELECT,
    Table,
    build,
    check_keys,
    render,
)

EXIT_BAD_INPUT = 2
EXIT_BUG = 1
DEFAULT_METRIC = "personal.L.avg"

EXAMPLES = """\
examples:
  fedbench-report multirun/2025-01-01/12-00-00
  fedbench-report multirun/ --rows algo --cols data,split --select best --format markdown
  fedbench-report sweep/ --metric personal.L.avg,personal.L.bottom5,personal.L.top5
  fedbench-report sweep/ --filter split.alpha=0.1 --cols participation --plots figs/
  fedbench-report sweep/ --preset diversifed_table1 --compact
  fedbench-report sweep/ --html results.html   # one self-contained page
  fedbench-report sweep/ --keys            # which config keys vary (to pick rows/cols)
  fedbench-report lr_sweep/ --best-of optim.lr --reference fedavg
  fedbench-report multirun/fedpg/table1_* --preset fedpg_table1 --best-of optim.lr

Cells are the mean ± sample std over the runs (seeds) that share the row and column
values; '—' marks a cell without runs, 'failed' one whose runs all stopped before
writing summary.json (or have files that cannot be read: a warning line names them), 'n/a'
a metric the runs do not have (e.g. a global model). With --best-of KEY a cell holds only
the runs of its best KEY value (noted in the cell: lr=0.05); with --reference ROW a cell
ends with its difference from ROW paired by seed and the 95% interval (+1.20 [0.40,
2.00], * when the interval excludes 0). Bad input is one line on stderr and exit code 2.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and exits; we want one line
        raise ReportError(message)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _digits(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_DIGITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of decimals (a whole number from 0 to {MAX_DIGITS})"
        )
    return n


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fedbench-report",
        description="Tables (and plots) of fedbench results from run directories and\n"
        "Hydra multirun directories, searched recursively.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="run or multirun directories")
    p.add_argument(
        "--rows",
        type=_csv,
        metavar="KEYS",
        help="config keys of the rows, comma-separated (default: algo); a key is a dotted "
        "config path (split.alpha, optim.lr) or algo, data, split, model, seed, rounds, "
        "clients, participation, per_round",
    )
    p.add_argument(
        "--cols",
        type=_csv,
        metavar="KEYS",
        help="config keys of the columns (default: every key other than the rows' and seed "
        "that differs between the runs; '' for none)",
    )
    p.add_argument(
        "--metric",
        action="append",
        type=_csv,
        metavar="M",
        help=f"what a cell shows (default: {DEFAULT_METRIC}); several (repeated or "
        f"comma-separated) are stacked in each cell, e.g. avg with bottom5/top5 beneath. "
        f"{METRIC_HELP}",
    )
    p.add_argument(
        "--select",
        choices=SELECT,
        help="the evaluation round a run contributes: val = the one with the highest "
        "validation V.avg of the model the metric is about (runs with split.val_frac > 0); "
        "last (or final) = the last; best_test (or best) = the one with the highest test "
        "L.avg (chosen on the test set: optimistic). Default: the runs' eval.select (val "
        "with validation sets), else last, or a preset's own rule with --preset",
    )
    p.add_argument(
        "--upto",
        type=_rounds,
        metavar="N",
        help="each run as if it had stopped after round N: its evaluations after round N "
        "are left out before --select picks (a table at a smaller budget from the same runs; "
        "reads metrics.csv)",
    )
    p.add_argument("--format", choices=FORMATS, default="terminal", help="output format")
    p.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a paper's table layout with its printed numbers beside ours, or leaderboard "
        f"(every algorithm on named federations: docs/leaderboard.md): "
        f"{', '.join(presets.names())}",
    )
    p.add_argument(
        "--compact",
        action="store_true",
        help="with --preset: leave out the rows and columns that no run fits",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keep only runs with this config value (repeatable; VALUE may be a "
        "comma-separated list of allowed values)",
    )
    p.add_argument(
        "--best-of",
        metavar="KEY",
        help="a grid key (e.g. optim.lr): in every cell only the runs of the KEY value with "
        "the best mean over seeds of --best-by, noted in the cell (the papers' 'best lr of "
        "a grid per method'); works with --preset",
    )
    p.add_argument(
        "--best-by",
        metavar="METRIC",
        help=f"what --best-of maximizes (minimizes for losses, times, sizes), at the round "
        f"--select picks (default: {VAL_BEST_BY}, the validation accuracy, where every run "
        f"has validation sets, else {DEFAULT_BEST_BY}, FedPG's (L + S + G) / 3 of the "
        f"personalized model on the test sets); any metric --metric accepts",
    )
    p.add_argument(
        "--reference",
        metavar="ROW",
        help="a row (e.g. fedavg; with --preset the paper's name, e.g. FedAvg): every other "
        "cell shows its difference from that row's cell, paired by seed, with the 95%% "
        "interval (paired t-test; a paired bootstrap without scipy) and * when significant",
    )
    p.add_argument(
        "--plots",
        metavar="DIR",
        help="also write the table and PNG figures (accuracy over rounds, per-client "
        "distribution, L/S/G bars, and each distinct split's label distribution "
        "partition_<run>.png) into DIR",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write one self-contained HTML page into FILE: the runs (finished, "
        "failed with their error), the table as printed, the keys that vary, and the "
        "figures of --plots embedded",
    )
    p.add_argument(
        "--cards",
        action="store_true",
        help="write a reproduction card (card.json, card.md) into every finished run's "
        "folder: the one-line command, wall time, machine, code and data, the paper tables "
        "it lands in beside the paper's number, the reason for a gap of more than 2 points "
        "(results/reasons.yaml); --html shows them too",
    )
    p.add_argument(
        "--digits",
        type=_digits,
        metavar="N",
        help=f"decimals, 0 to {MAX_DIGITS} (default: 2; 3 with --fraction)",
    )
    p.add_argument(
        "--fraction",
        action="store_true",
        help="accuracies as fractions in [0, 1] instead of percent",
    )
    p.add_argument(
        "--keys", action="store_true", help="list the config keys that differ between the runs"
    )
    p.add_argument("--list-presets", action="store_true", help="list the paper presets")
    return p


# --------------------------------------------------------------------------- steps
def apply_filters(runs: list[RunDir], filters: list[str]) -> list[RunDir]:
    for f in filters:
        key, eq, text = f.partition("=")
        if not eq or not key:
            raise ReportError(f"--filter {f!r}: expected KEY=VALUE")
        check_keys([key], runs)
        value = parse_value(text)
        allowed = [parse_value(v) for v in text.split(",")] if isinstance(value, str) else [value]
        runs = [r for r in runs if any(same_value(r.get(key), v) for v in allowed)]
        if not runs:
            raise ReportError(f"no runs left after --filter {f}")
    return runs


def list_keys(runs: list[RunDir]) -> str:
    lines = []
    for k in [*varying_keys(runs), "seed"]:
        values = sorted({hashable(r.get(k)) for r in runs}, key=sort_key)
        lines.append(f"{k}: {', '.join(format_value(v) for v in values)}")
    done = sum(not r.failed for r in runs)
    bad = sum(r.unreadable for r in runs)
    lines.append(
        f"({len(runs)} runs, {done} finished, {len(runs) - done - bad} without summary.json"
        + (f", {bad} with unreadable files)" if bad else ")")
    )
    return "\n".join(lines) + "\n"


def best_of(args: argparse.Namespace, runs: list[RunDir]) -> BestOf | None:
    if args.best_by and not args.best_of:
        raise ReportError("--best-by goes with --best-of KEY")
    if not args.best_of:
        return None
    check_keys([args.best_of], runs)
    by = args.best_by or default_best_by(runs)
    check_metric(by, runs)
    for flag, keys in (("--rows", args.rows), ("--cols", args.cols)):
        if args.best_of in (keys or []):
            raise ReportError(f"--best-of {args.best_of} is chosen per cell; drop it from {flag}")
    return BestOf(args.best_of, by)


def auto_cols(runs: list[RunDir], rows: list[str], exclude: list[str]) -> tuple[list, list]:
    """The columns when --cols is not given: the keys that differ between the runs, other
    than the rows', `exclude` and those whose value follows from the rows' and the columns'
    before them (they would split no cell: algo.weighting between algorithms whose YAMLs
    set it differently). Returns (columns, [(left-out key, what it follows)])."""
    cols: list[str] = []
    left_out = []
    long_rows = {ALIASES.get(k, k) for k in rows}
    for k in varying_keys(runs):
        if k in rows or k in long_rows or k in exclude:
            continue
        if follows(k, rows + cols, runs):
            left_out.append((k, rows + cols))
        else:
            cols.append(k)
    return cols, left_out


def make_table(args: argparse.Namespace, runs: list[RunDir]) -> Table:
    scale = 1.0 if args.fraction else 100.0
    digits = args.digits if args.digits is not None else (3 if args.fraction else 2)
    best = best_of(args, runs)
    fallback = presets.get(args.preset).select if args.preset else "final"
    select = args.select or default_select(runs, fallback, warn=_warn)
    if args.preset:
        if args.rows or args.cols is not None or args.metric:
            raise ReportError(
                "--preset lays out its own rows, columns and metric; drop --rows/--cols/--metric"
            )
        if args.fraction:
            raise ReportError("--preset prints accuracies as its paper does (percent)")
        table, _ = presets.get(args.preset).build(
            runs, select, compact=args.compact, best_of=best, digits=digits
        )
    else:
        if args.compact:
            raise ReportError("--compact goes with --preset")
        metrics = [m for group in (args.metric or [[DEFAULT_METRIC]]) for m in group]
        for m in metrics:
            check_metric(m, runs)
        rows = args.rows or ["algo"]
        check_keys(rows, runs)
        left_out = []
        if args.cols is not None:
            cols = args.cols
        else:
            cols, left_out = auto_cols(runs, rows, [best.key] if best else [])
        table = build(runs, rows, cols, metrics, select, scale, digits, best)
        if left_out:
            table.notes.append(
                "not columns (each follows from the keys named): "
                + "; ".join(f"{k} ({', '.join(by)})" for k, by in left_out)
            )
    if args.reference:
        compare_to(table, args.reference)
    if args.upto is not None:
        table.notes.append(
            f"up to round {args.upto} (--upto): every run's evaluations after round "
            f"{args.upto} left out, as if it had stopped there"
        )
    return table


def _rounds(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of rounds") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: a round, >= 0")
    return n


def truncated(run: RunDir, upto: int) -> RunDir:
    """`run` as if it had stopped after round `upto`: its metrics.csv rows up to that round,
    and `rounds` at most `upto` in its config (it pools with runs of that length). A run
    without them (no metrics.csv, or no evaluation by then) counts as failed, with the
    reason: summary.json's numbers are the whole run's."""
    if run.failed:
        return run
    config = dict(run.config)
    if isinstance(config.get("rounds"), int):  # a longer run cut here is a run of `upto` rounds
        config["rounds"] = min(config["rounds"], upto)
    m = run.metrics
    why = None
    if m is None:
        why = "no metrics.csv to cut at a round (--upto)"
    elif not (m["round"] <= upto).any():
        why = f"no evaluation at or before round {upto} (--upto)"
    if why:
        return replace(run, config=config, problems=[*run.problems, why])
    cut = replace(run, config=config)
    cut.__dict__["metrics"] = m[m["round"] <= upto].reset_index(drop=True)
    return cut


def check_output_dir(text: str) -> Path:
    """--plots DIR, checked before anything is read or written: DIR is a directory or can
    be made one (the nearest existing folder on its path is writable)."""
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--plots {out}: exists and is not a directory")
    here = out
    while not here.exists() and here.parent != here:
        here = here.parent
    if not here.is_dir():
        raise ReportError(f"--plots {out}: {here} is not a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        why = "permission denied"
        with contextlib.suppress(OSError, AttributeError):
            if os.statvfs(here).f_flag & os.ST_RDONLY:
                why = "read-only file system"
        raise ReportError(f"--plots {out}: cannot write in {here} ({why})")
    return out


def check_output_file(text: str, flag: str = "--html") -> Path:
    """An output FILE, checked before anything is read or written: not a directory, and
    its folder is one or can be made one (as --plots DIR)."""
    out = Path(text)
    if out.is_dir():
        raise ReportError(f"{flag} {out}: is a directory (give a file name)")
    if not out.name:
        raise ReportError(f"{flag} {text!r}: give a file name")
    folder = out.parent
    if folder.exists() and not folder.is_dir():
        raise ReportError(f"{flag} {out}: {folder} is not a directory")
    try:
        check_output_dir(str(folder))
    except ReportError as e:
        raise ReportError(str(e).replace(f"--plots {folder}", f"{flag} {out}", 1)) from None
    return out


def _silence_stdout() -> None:
    """After a failed write to stdout, send what is still buffered to /dev/null: Python's
    own flush at exit would otherwise fail again and print its own error."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass  # no file descriptor (a test's captured stream): nothing to silence


def emit(text: str) -> None:
    """`text` to stdout, flushed now; a closed pipe or a full disk is a ReportError."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        _silence_stdout()
        raise ReportError(f"cannot write to standard output: {e.strerror or e}") from None


def _internal_error(e: BaseException) -> str:
    """The line for a fedbench-report bug; its traceback goes to a file (if one can be
    written)."""
    import tempfile
    import traceback

    what = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    try:
        fd, path = tempfile.mkstemp(prefix="fedbench-report-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(" ".join(sys.argv) + "\n\n")
            traceback.print_exception(e, file=f)
        where = f"the traceback is in {path}"
    except OSError:
        where = "no traceback file could be written"
    return f"fedbench-report: internal error ({what[:200]}); {where}: please report it"


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr)


def _warn(message: str) -> None:
    _say(f"fedbench-report: warning: {message}")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ReportError as e:
        _say(f"fedbench-report: {e}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("fedbench-report: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 (a bug: one line, the traceback in a file)
        _say(_internal_error(e))
        return EXIT_BUG


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.list_presets:
        lines = [
            f"{name:20s} {p.title} (select {p.select})\n"
            for name, p in ((n, presets.get(n)) for n in presets.names())
        ]
        emit("".join(lines))
        return 0
    if not args.paths:
        raise ReportError("give at least one run or multirun directory")
    if args.preset:
        presets.get(args.preset)  # an unknown name is an error before any reading
    out = check_output_dir(args.plots) if args.plots else None
    html_out = check_output_file(args.html) if args.html else None
    unlisted: list[str] = []  # folders that could not be searched
    runs = find_runs(args.paths, warn=unlisted.append)
    if not runs:
        where = ", ".join(args.paths)
        raise ReportError(
            f"no runs found under {where} (a run directory holds .hydra/config.yaml "
            "or summary.json)" + (f"; {unlisted[0]}" if unlisted else "")
        )
    for message in unlisted:
        _say(f"fedbench-report: warning: {message}")
    if all(not r.config for r in runs):
        first = runs[0]
        raise ReportError(
            f"no readable run under {', '.join(args.paths)}: {len(runs)} run director"
            f"{'y' if len(runs) == 1 else 'ies'}, none with a readable config or summary "
            f"({first.path}: {'; '.join(first.problems) or 'empty'})"
        )
    for r in runs:
        if r.unreadable:
            _say(
                f"fedbench-report: warning: {r.path}: {'; '.join(r.problems)}; "
                "the run counts as failed"
            )
    runs = apply_filters(runs, args.filter)
    if args.upto is not None:
        runs = [truncated(r, args.upto) for r in runs]
        for r in runs:
            if r.problems and "(--upto)" in r.problems[-1]:
                _say(f"fedbench-report: warning: {r.path}: {r.problems[-1]}; it counts as failed")
    if args.keys:
        emit(list_keys(runs))
        return 0
    if args.cards:
        emit(write_cards(args.paths, runs))
        return 0
    table = make_table(args, runs)
    text = render(table, args.format)
    emit(text)
    if out is not None:
        from fedbench.report.plots import write_plots

        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ReportError(f"--plots {out}: cannot create it ({e.strerror or e})") from None
        write_output(out / f"table.{EXTENSION[args.format]}", text.encode())
        plots = write_plots(table, out, warn=_warn)
        for path in plots:
            _say(f"wrote {path}")
    if html_out is not None:
        write_html(html_out, table, runs, args, plots if out is not None else None)
        _say(f"wrote {html_out}")
    return 0


def write_cards(paths: list[str], runs: list[RunDir]) -> str:
    """--cards: card.json and card.md into every finished run's folder; one line per card
    (a gap of more than 2 points without a reason says so)."""
    from fedbench.report import cards

    made = cards.build_cards(paths, runs)
    if not made:
        raise ReportError("no finished run to write a card for")
    cards.write_cards(made)
    lines = []
    for folder, card in made:
        gap = "" if card.max_gap is None else f"; max gap to the paper {card.max_gap:.2f} points"
        if card.needs_reason and not card.reason:
            gap += " and NO REASON (add one to reasons.yaml)"
        lines.append(f"card: {folder / cards.CARD_MD}{gap}\n")
    missing = sum(c.needs_reason and not c.reason for _, c in made)
    lines.append(
        f"{len(made)} card(s) written; {sum(c.needs_reason for _, c in made)} more than "
        f"{cards.GAP:g} points from their paper, {missing} of them without a reason\n"
    )
    return "".join(lines)


def write_html(
    path: Path, table: Table, runs: list[RunDir], args: argparse.Namespace, plots=None
) -> None:
    """The results page (fedbench.report.html) into `path`, written whole or not at all;
    the figures are those --plots wrote, else drawn into a temporary folder."""
    import shlex
    import tempfile

    from fedbench.report.cards import build_cards
    from fedbench.report.html import page
    from fedbench.report.plots import write_plots

    command = shlex.join(["fedbench-report", *(args.argv or [])])
    cards = [card for _, card in build_cards(args.paths, runs)]
    with tempfile.TemporaryDirectory(prefix="fedbench-report-") as tmp:
        if plots is None:
            plots = write_plots(table, tmp, warn=_warn)
        text = page(table, runs, args.paths, plots, command=command, cards=cards)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(
            f"--html {path}: cannot create {path.parent} ({e.strerror or e})"
        ) from None
    write_output(path, text.encode("utf-8"))


if __name__ == "__main__":
    sys.exit(main())
