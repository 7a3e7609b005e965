"""What made a result: the code (fedbench's version and git commit), torch, the machine, and
the digest of the data it trained on. Written into summary.json and the checkpoint, so a
number in results/ names the code and data behind it, and a resume can refuse other data."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from pathlib import Path

import torch

import fedbench

_REPO = Path(fedbench.__file__).resolve().parent.parent


@cache
def code_commit() -> str | None:
    """The checkout's commit (with '+dirty' when tracked files differ from it), or None for
    an installed package outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(_REPO), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        if not (_REPO / ".git").exists():
            return None
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "fedbench", "conf")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


@cache
def machine(device: str = "cpu") -> str:
    """'<CPU model>, N cores' (and the GPU's name for a CUDA device)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    out = f"{cpu}, {os.cpu_count()} cores"
    if device.startswith("cuda") and torch.cuda.is_available():
        out += f"; {torch.cuda.get_device_name(torch.device(device))}"
    return out


def provenance(data_digest: str, device: str = "cpu") -> dict:
    """The record a run keeps of what made it."""
    return {
        "version": fedbench.__version__,
        "commit": code_commit(),
        "torch": torch.__version__,
        "machine": machine(device),
        # torch's intra-op threads: another count sums in another order (other last bits)
        "threads": torch.get_num_threads(),
        "data_digest": data_digest,
    }
