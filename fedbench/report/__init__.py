"""Tables and plots from fedbench run directories (`fedbench-report`, docs/metrics.md
"Tables"): collect runs, group them into cells, aggregate seeds, print or plot.

    from fedbench.report import find_runs, build, render
    table = build(find_runs(["multirun/"]), rows=["algo"], cols=["data"],
                  metrics=["personal.L.avg"], select="best")
    print(render(table, "markdown"))

`build(..., best_of=BestOf("optim.lr"))` keeps the best lr's runs per cell;
`compare_to(table, "fedavg")` adds differences from a row paired by seed;
`fedbench.report.partition.plot_partition(run_dir, png)` draws a run's split.
"""

from fedbench.report.collect import RunDir, find_runs, read_run
from fedbench.report.compare import BestOf, compare_to
from fedbench.report.presets import PRESETS
from fedbench.report.table import Cell, Table, build, render

__all__ = [
    "PRESETS",
    "BestOf",
    "Cell",
    "RunDir",
    "Table",
    "build",
    "compare_to",
    "find_runs",
    "read_run",
    "render",
]
