"""Where fedbench's Hydra configs are: `fedbench/conf` in an installed package (the
repository's `conf/`, shipped by pyproject's package-dir), `conf/` in a checkout."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
CONF_DIR = _HERE / "conf" if (_HERE / "conf").is_dir() else _HERE.parent / "conf"
