"""fedbench: a benchmark for personalized federated learning."""

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


if not OmegaConf.has_resolver("fedbench.choice"):
    OmegaConf.register_new_resolver("fedbench.choice", _choice)
