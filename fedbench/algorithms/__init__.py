"""Algorithms, one module per family. Importing this package imports every module in it,
which fills the ALGORITHMS registry (a new family needs no edit here)."""

import importlib
import pkgutil

from fedbench.algorithms.base import ALGORITHMS, Algorithm

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_") and _m.name not in ("base", "params"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["ALGORITHMS", "Algorithm"]
