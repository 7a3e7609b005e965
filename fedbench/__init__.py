"""fedbench: a benchmark for personalized federated learning."""

import hashlib

from omegaconf import OmegaConf

__version__ = "0.1.0"


def _choice(group: str, *, _root_) -> str:
    """`${fedbench.choice:algo}`: the option chosen for a config group, so that an option's
    name is its file's (conf/algo/fedper.yaml is algo `fedper`) and written nowhere else.
    Read from the composed config's hydra node when it has one (the compose API with
    return_hydra_config), else from the running Hydra app."""
    chosen = OmegaConf.select(_root_, f"hydra.runtime.choices.{group}", default=None)
    if chosen is None:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            chosen = HydraConfig.get().runtime.choices.get(group)
    if chosen is None:
        raise ValueError(
            f"the {group} option is known only in a config composed by Hydra "
            "(compose(..., return_hydra_config=True), or the running app)"
        )
    return str(chosen)


CELL_NAME_BYTES = 200  # a file name may have 255 bytes: room for Hydra's and our suffixes


def cell_name(overrides: str) -> str:
    """A table cell's directory name: its overrides themselves (`algo=fedavg,seed=0`) when
    they fit in a file name, else their first bytes and a digest of the whole (a sweep with
    many overrides would otherwise stop on "File name too long"). A function of the
    overrides alone: a later sweep finds the same cell. A job without overrides (every key
    at its default, or only keys that make no other run) is `defaults`."""
    if not overrides:
        return "defaults"
    raw = overrides.encode()
    if len(raw) <= CELL_NAME_BYTES:
        return overrides
    digest = hashlib.sha256(raw).hexdigest()[:16]
    head = raw[: CELL_NAME_BYTES - len(digest) - 1].decode(errors="ignore")
    return f"{head}~{digest}"


def _cell(*, _root_) -> str:
    """`hydra.sweep.subdir=${fedbench.cell:}`: the job's cell_name of its
    hydra.job.override_dirname (the table scripts' cell directories)."""
    name = OmegaConf.select(_root_, "hydra.job.override_dirname", default=None)
    if name is None:
        from hydra.core.hydra_config import HydraConfig

        name = HydraConfig.get().job.override_dirname
    return cell_name(str(name))


if not OmegaConf.has_resolver("fedbench.choice"):
    OmegaConf.register_new_resolver("fedbench.choice", _choice)
if not OmegaConf.has_resolver("fedbench.cell"):
    OmegaConf.register_new_resolver("fedbench.cell", _cell)
