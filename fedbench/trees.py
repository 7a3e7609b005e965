"""A config as plain nested containers: resolved (`plain`) and flattened to dotted keys
(`flat_items`), for comparing a resumed run's config and for the tracking sinks."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def plain(cfg: DictConfig | dict | None) -> dict:
    """The config as plain resolved containers ({} for None)."""
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


def flat_items(node: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a plain nested dict (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
