"""Checkpoints: what a run saves to continue exactly, how it is written and verified, and the
checks that decide whether a resume may continue it.

A checkpoint is data, never code: `checkpoint.pt` holds tensors and plain values (dicts,
lists, tuples, str, bytes, int, float, bool, None) and is read with `torch.load(...,
weights_only=True)`, which refuses any other pickled global; the only classes allowed are
`SAFE_CLASSES` (plain records of str and int). `save` checks that (`_data_only`), so a state
that would not load again fails when it is written, not when it is resumed.

A damaged checkpoint is detected: `checkpoint.pt.sha256` beside it lists the SHA-256 of the
checkpoint's bytes (`sha256sum -c` reads it), and a load verifies it first. The two files
are written so that a kill at any moment leaves a pair that verifies a complete checkpoint:
the new checkpoint's bytes are written and synced under a temporary name; the digest file
then lists both the current checkpoint's digest and the new one; the new checkpoint is
renamed into place; the digest file then lists the new one only. A checkpoint saved by an
older fedbench (no digest file, no `format` entry) is verified by its zip's CRC-32s.

Per-client rows (`fedbench.engine.ClientRows`: personal models, control variates, kept
optimizer state) are not in `checkpoint.pt`: each store is cut into shards of consecutive
clients, raw bytes in `checkpoint.rows/<store>.<shard>.<sha256[:16]>.bin`, and `checkpoint.pt`
holds the store's manifest (every shard's file name and SHA-256). A save writes the shards
holding a row written since the last save, under names never used by the checkpoint on disk,
before `checkpoint.pt` is replaced; once the new pair is in place, the shard files it does
not name are removed. So a kill at any moment leaves the checkpoint that verifies with all
its shards, and a checkpoint's bytes follow the clients that trained since the previous one.
A load verifies each shard's SHA-256 against the (verified) manifest; a resume checks them all
before anything is written (`check_resume`). Shards are raw numbers: loading runs no code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.torch_version import TorchVersion

import fedbench
from fedbench.config import absent_means, resume_may_change
from fedbench.engine.prox import LayerRank
from fedbench.engine.rows import ROWS_KEY, ClientRows, SavedRows
from fedbench.errors import ConfigError, FedbenchError
from fedbench.io import atomic_write, atomic_write_text
from fedbench.rundir import holds_run
from fedbench.trees import flat_items, plain

log = logging.getLogger("fedbench")

CHECKPOINT = "checkpoint.pt"
ROWS_DIR = "checkpoint.rows"  # the shards of per-client rows, beside checkpoint.pt
DIGEST_SUFFIX = ".sha256"  # checkpoint.pt.sha256: the checkpoint's SHA-256, as sha256sum writes
# 2: the digest file exists and the state is data only. A checkpoint without the key is an
# older fedbench's (no digest file: its zip CRCs are checked instead).
FORMAT = 2
# The classes a checkpoint may name besides tensors and plain values: `bytes` (pickle's
# protocol 2, torch.save's, writes b"" as a call of bytes()), and records of str and int that
# unpickle by setting their fields (FedSLR's layer ranks; torch's version string, a str, as
# fedbench 0.x saved it). None of them runs code when it is read.
SAFE_CLASSES = (bytes, LayerRank, TorchVersion)

# Keys a resumed run may change (a group: all its keys) and the values of keys a run saved
# before they existed had: marks on the schema's fields (fedbench/config.py, `hp(resume=True,
# absent=...)`), read here once.
RESUME_MAY_CHANGE = resume_may_change()
ABSENT_MEANS = absent_means()


class CheckpointError(FedbenchError):
    """checkpoint.pt cannot be used: cut off, damaged, changed, or not fedbench's data."""


# ----------------------------------------------------------------------------- config checks
def resume_differences(saved: dict, now: dict) -> list[str]:
    """'key (checkpoint -> now)' for every key outside RESUME_MAY_CHANGE that differs."""
    return config_differences(saved, now, RESUME_MAY_CHANGE)


def config_differences(saved: dict, now: dict, ignore) -> list[str]:
    """'key (saved -> now)' for every differing key of two plain configs, but the keys
    under `ignore` and a key added since `saved` was written at its ABSENT_MEANS value."""
    a, b = flat_items(saved), flat_items(now)
    missing = object()
    out = []
    for k in sorted(set(a) | set(b)):
        if any(k == p or k.startswith(p + ".") for p in ignore):
            continue
        va, vb = a.get(k, missing), b.get(k, missing)
        if va is missing and ABSENT_MEANS.get(k, missing) == vb:
            continue  # a key added since the run was saved, at the value that changes nothing
        if va != vb:
            show = lambda v: "absent" if v is missing else repr(v)  # noqa: E731
            out.append(f"{k} ({show(va)} -> {show(vb)})")
    return out


def _flag(cfg: DictConfig) -> str:
    return "resume=auto" if cfg.get("resume") == "auto" else "resume=true"


def _refuse_differences(saved: dict, cfg: DictConfig, source: Path) -> None:
    diff = resume_differences(saved, plain(cfg))
    if diff:
        raise ConfigError(
            f"{_flag(cfg)}: the config differs from {source}'s in {', '.join(diff)}; resume "
            f"with its values or start a new run directory (only "
            f"{', '.join(RESUME_MAY_CHANGE)} may change)"
        )


def _saved_config(path: Path, cfg: DictConfig) -> dict:
    try:
        return plain(OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 (a corrupt YAML: one line)
        why = " ".join(str(e).split())[:160]
        raise ConfigError(f"{_flag(cfg)}: {path} cannot be read ({why})") from None


@dataclass(frozen=True)
class Saved:
    """What a resume continues from: the checkpoint, its rounds done and its provenance
    (None: saved before provenance was recorded)."""

    path: Path
    next_round: int
    provenance: dict | None


def check_resume(cfg: DictConfig, out: str | Path, *, expect_run: bool = False) -> Saved | None:
    """With resume=true or auto: raise ConfigError (one line, before any file is written)
    unless the run in `out` was started by this config, up to RESUME_MAY_CHANGE (the
    checkpoint's config, else .hydra/config.yaml), and `rounds` is at least the rounds it has
    done; a damaged or foreign checkpoint is CheckpointError. Returns the checkpoint to
    continue from (check its data with `check_data` once loaded), or None: nothing to load
    (a run killed before its first checkpoint starts again; a finished run (`finished`) is
    neither loaded nor written). `expect_run`: a single run's resume=true (the CLI), where a
    missing or empty directory is a typo, not a sweep's job that has not started yet."""
    out = Path(out)
    path = out / CHECKPOINT
    if finished(cfg, out) is not None:
        return None  # skipped by the caller: nothing is loaded
    if not path.exists():
        if (out / "summary.json").exists():
            raise ConfigError(
                f"{_flag(cfg)}: {out} holds a finished run without {CHECKPOINT} "
                "(checkpoint.every=0); start a new run directory"
            )
        saved_cfg = out / ".hydra" / "config.yaml"
        if saved_cfg.is_file():
            _refuse_differences(_saved_config(saved_cfg, cfg), cfg, saved_cfg)
        elif holds_run(out):
            raise ConfigError(
                f"{_flag(cfg)}: {out} holds run files ({', '.join(holds_run(out))}) but no "
                "checkpoint or config to check them against; start a new run directory"
            )
        elif expect_run and cfg.get("resume") is True:
            what = "is empty" if out.is_dir() else "does not exist"
            raise ConfigError(
                f"resume=true: {out} {what}: there is no run to resume; check the "
                "directory, or give resume=auto to start a run where there is none"
            )
        return None
    state, _ = load_verified(path, mmap=True)
    verify_rows(state, path)  # every shard of per-client rows, before anything is written
    saved, source = state.get("config"), path
    if saved is None:  # an older fedbench's checkpoint: its run's .hydra/config.yaml
        source = out / ".hydra" / "config.yaml"
        if not source.is_file():
            raise ConfigError(
                f"{_flag(cfg)}: {path} has no saved config and {source} is missing: nothing "
                "to check this config against; start a new run directory"
            )
        saved = _saved_config(source, cfg)
    _refuse_differences(saved, cfg, source)
    if state.get("augment") is not None:
        # fedbench before keyed augmentation: its crops came from one federation-wide
        # stream, which this fedbench no longer draws; a resume would mix the two
        raise ConfigError(
            f"{_flag(cfg)}: {path} was saved by an older fedbench whose data.augment crops "
            "came from one shared stream; this version draws them per client and batch, "
            "so the run cannot continue exactly: start a new run directory"
        )
    done = int(state["progress"]["next_round"])
    if int(cfg.rounds) < done:
        raise ConfigError(
            f"{_flag(cfg)}: rounds={cfg.rounds} but {path} has {done} rounds done; "
            f"rounds must be >= {done}"
        )
    prov = state.get("provenance")
    return Saved(path, done, dict(prov) if isinstance(prov, dict) else None)


def check_data(saved: Saved | None, data_digest: str) -> None:
    """A resume trains on the data its run trained on: ConfigError (one line) when the
    loaded data's digest (`Dataset.digest`: content, not paths) differs from the checkpoint's.
    A checkpoint without one (an older fedbench) is continued with a warning."""
    if saved is None:
        return
    want = (saved.provenance or {}).get("data_digest")
    if want is None:
        log.warning(
            "%s records no data digest (saved by an older fedbench): the data this resume "
            "trains on are not checked against the run's",
            saved.path,
        )
        return
    if want != data_digest:
        raise ConfigError(
            f"resume: the data (SHA-256 {data_digest[:16]}...) are not those the run in "
            f"{saved.path.parent} trained on ({want[:16]}... in {CHECKPOINT}); resume with "
            "that run's data files (data.root), or start a new run directory"
        )


def finished_run(cfg: DictConfig, out: str | Path) -> dict | None:
    """The summary of the run in `out` if it finished `cfg.rounds` rounds with this config
    (up to RESUME_MAY_CHANGE, compared with its .hydra/config.yaml); else None. Reads two
    small files: resume=auto skips a finished cell without loading any data."""
    out = Path(out)
    try:
        summary = json.loads((out / "summary.json").read_text())
        saved = plain(OmegaConf.load(out / ".hydra" / "config.yaml"))
    except Exception:  # noqa: BLE001 (missing or unreadable: not a finished run)
        return None
    if not isinstance(summary, dict):
        return None
    if summary.get("rounds") != int(cfg.rounds) or resume_differences(saved, plain(cfg)):
        return None
    return summary


@dataclass(frozen=True)
class Finished:
    """A finished run that a resume leaves as it is: its summary and the line to print."""

    summary: dict
    line: str


def finished(cfg: DictConfig, out: str | Path) -> Finished | None:
    """resume=auto or resume=true of a run that finished `cfg.rounds` rounds with this config:
    nothing to do, so nothing is loaded (not even the checkpoint) and nothing written. With
    resume=true a run whose metrics.csv is missing is not finished: its resume restores it."""
    mode = cfg.get("resume")
    if mode is not True and mode != "auto":
        return None
    summary = finished_run(cfg, out)
    if summary is None:
        return None
    n = summary["rounds"]
    if mode == "auto":
        return Finished(summary, f"{out} already finished (round {n}): skipped")
    if not (Path(out) / "metrics.csv").is_file():
        return None
    line = f"{out} already finished at round {n}; to extend it give rounds=<more>"
    return Finished(summary, line)


# ----------------------------------------------------------------------------- the state
class RunParts(Protocol):
    """What a checkpoint saves of a run besides the loop's progress (fedbench.runner.Run)."""

    cfg: DictConfig
    algo: Any
    engine: Any
    sampler: np.random.Generator
    attack: Any
    provenance: dict


def run_state(run: RunParts, progress: dict) -> dict:
    """Algorithm state, engine optimizer state, RNG states (the client sampler's, the
    attack's; augmentation is keyed, nothing to keep), the loop's progress, the config
    (a resume checks the new one against it) and the provenance (its data digest)."""
    return {
        "format": FORMAT,
        "progress": progress,
        "algo": run.algo.state_dict(),
        "engine": run.engine.state_dict(),
        "sampler": run.sampler.bit_generator.state,
        # the attack's Gaussian stream (A1), so that a resumed run draws the same noise
        "attack": None if run.attack is None else run.attack.rng_state(),
        "version": fedbench.__version__,
        "provenance": run.provenance,
        "config": plain(run.cfg),
    }


def restore_state(run: RunParts, state: dict) -> None:
    """Load a checkpoint's state into the run's algorithm, engine and generators."""
    run.algo.load_state_dict(state["algo"])
    run.engine.load_state_dict(state["engine"])
    run.sampler.bit_generator.state = state["sampler"]
    if run.attack is not None and state.get("attack") is not None:
        run.attack.set_rng_state(state["attack"])


def drop_final_only(progress: dict, rounds: int, every: int) -> dict:
    """A run extended past the rounds it finished: the evaluation it made only because it
    ended there (its last round not a multiple of eval.every) is not one an uninterrupted
    longer run makes (unless the extension's eval.every has it); its metrics row, client rows
    and its part in best, final and size go."""
    before = progress.pop("pre_final", None)
    done = int(progress["next_round"])
    if before is not None and rounds > done and done % every:
        progress.update(before)
    elif before is not None and rounds == done:
        progress["pre_final"] = before  # not extended: kept for a later extension
    return progress


def cut_files(out: Path, progress: dict) -> None:
    """metrics.csv as the checkpoint recorded it; clients.csv cut back to its length (rows
    written after the checkpoint are made again)."""
    atomic_write(out / "metrics.csv", lambda f: f.write(progress["metrics_csv"]))
    if "clients_csv_old" in progress:
        old = progress.pop("clients_csv_old")
        progress["clients_len"] = atomic_write(out / "clients.csv", lambda f: f.write(old))
    cpath, want = out / "clients.csv", int(progress["clients_len"])
    have = cpath.stat().st_size if cpath.exists() else 0
    if have < want:
        log.warning(
            "clients.csv has %d bytes, the checkpoint recorded %d: per-client rows of "
            "rounds up to %d are lost; the run appends from here",
            have,
            want,
            progress["next_round"],
        )
        progress["clients_len"] = have
    elif have > want:
        with open(cpath, "r+b") as f:
            f.truncate(want)


def _data_only(x: Any, where: str = "state") -> Any:
    """`x` as tensors and plain values that `torch.load(weights_only=True)` reads back
    as they were: numpy scalars become Python numbers, str subclasses str; anything else
    is a bug of the state's owner (TypeError naming where it is)."""
    if x is None or type(x) in (bool, int, float, str, bytes) or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, str):
        return str(x)
    if type(x) in SAFE_CLASSES:
        return x
    if type(x) in (dict, OrderedDict):
        out = type(x)()
        for k, v in x.items():
            if k is not None and type(k) not in (bool, int, float, str):
                raise TypeError(f"checkpoint: {where} has a key of type {type(k).__name__}")
            out[k] = _data_only(v, f"{where}.{k}")
        if hasattr(x, "_metadata"):  # a module's state_dict: its version record
            out._metadata = _data_only(x._metadata, f"{where}._metadata")  # type: ignore[attr-defined]
        return out
    if type(x) in (list, tuple):
        return type(x)(_data_only(v, f"{where}[{i}]") for i, v in enumerate(x))
    raise TypeError(
        f"checkpoint: {where} is a {type(x).__module__}.{type(x).__qualname__}; a checkpoint "
        "holds tensors and plain values only (convert it in state_dict, or add a plain "
        "record class to fedbench.checkpoint.SAFE_CLASSES)"
    )


# ----------------------------------------------------------------------------- files
def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


class _Hashing:
    """A binary file that hashes what is written through it."""

    def __init__(self, f: IO[bytes], h: Any) -> None:
        self._f, self._h = f, h

    def write(self, data: bytes) -> int:
        self._h.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()


def _write_digests(path: Path, digests: list[str]) -> None:
    lines = "".join(f"{d}  {path.name}\n" for d in dict.fromkeys(digests))
    atomic_write_text(digest_path(path), lines)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _externalize(x: Any, write) -> tuple[Any, int]:
    """`x` with every `ClientRows` replaced by its manifest, its changed shards written by
    `write`; and the shard bytes written."""
    if isinstance(x, ClientRows):
        return x.save(write)
    if isinstance(x, SavedRows):  # a loaded state saved again: its shards are on disk
        return x.manifest, 0
    if type(x) in (dict, OrderedDict):
        out, n = type(x)(), 0
        for k, v in x.items():
            out[k], m = _externalize(v, write)
            n += m
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata  # type: ignore[attr-defined]
        return out, n
    if type(x) in (list, tuple):
        parts = [_externalize(v, write) for v in x]
        return type(x)(p for p, _ in parts), sum(m for _, m in parts)
    return x, 0


def _manifests(x: Any) -> Iterator[Any]:
    """The rows stores of a checkpoint's state: manifests (plain dicts, as saved) or
    `SavedRows` (as loaded)."""
    if isinstance(x, SavedRows):
        yield x
    elif isinstance(x, dict):
        if x.get(ROWS_KEY) is not None:
            yield x
        else:
            for v in x.values():
                yield from _manifests(v)
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _manifests(v)


def _shard_files(state: dict) -> set[str]:
    return {str(f) for m in _manifests(state) for f, _ in m["shards"].values()}  # saved form


def save(path: Path, state: dict, previous: str | None = None) -> tuple[int, str]:
    """Write `state` to `path` (streamed, atomically) and its SHA-256 to `path`.sha256, in an
    order that a kill at any moment leaves verifiable (module docstring), its per-client rows
    as shards in `checkpoint.rows/` (the changed ones). `previous`: the digest of the
    checkpoint now at `path` (computed when None and the file exists). Returns the bytes
    written (checkpoint.pt and the shards) and the new digest."""
    rows_dir = path.parent / ROWS_DIR

    def write_shard(stem: str, data: bytes) -> tuple[str, str]:
        digest = _sha256(data)
        name = f"{stem}.{digest[:16]}.bin"
        atomic_write(rows_dir / name, lambda f: f.write(data))
        return name, digest

    state, shard_bytes = _externalize(state, write_shard)
    data = _data_only(state)
    if previous is None and path.exists():
        previous = file_digest(path)
    h = hashlib.sha256()

    def announce() -> None:  # the new bytes are on disk; `path` is still the previous file
        _write_digests(path, [previous, h.hexdigest()] if previous else [h.hexdigest()])

    size = atomic_write(path, lambda f: torch.save(data, _Hashing(f, h)), before_replace=announce)
    digest = h.hexdigest()
    _write_digests(path, [digest])
    if rows_dir.is_dir():  # shards no checkpoint names any more (and a killed save's)
        keep = _shard_files(data)
        for p in rows_dir.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
    return size + shard_bytes, digest


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _listed_digests(side: Path, path: Path) -> set[str]:
    try:
        text = side.read_text(encoding="ascii")
        out = set()
        for line in text.splitlines():
            digest, _, name = line.partition("  ")
            if name != path.name or len(digest) != 64:
                raise ValueError(line[:80])
            int(digest, 16)
            out.add(digest)
        if not out:
            raise ValueError("empty")
        return out
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"resume: {side} cannot be read ({type(e).__name__}: {e}); it was damaged: "
            "restore it with its checkpoint, or start a new run directory"
        ) from None


def _crc_check(path: Path) -> None:
    """An older fedbench's checkpoint (no digest file): the CRC-32 of every zip record."""
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    if bad is not None:
        raise ValueError(f"the CRC-32 of {bad} does not match")


def load_verified(
    path: Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> tuple[dict, str]:
    """The checkpoint's state and digest, its bytes verified against `path`.sha256 and read as
    data only; CheckpointError (one line) for a damaged, changed or foreign file. `mmap`: map
    the tensors instead of reading them (a check that only needs the config)."""
    path = Path(path)
    side = digest_path(path)
    listed = _listed_digests(side, path) if side.exists() else None

    def unreadable(e: BaseException) -> CheckpointError:
        why = " ".join(str(e).split())[:160]
        return CheckpointError(
            f"resume: {path} cannot be read ({type(e).__name__}: {why}); it was cut off or "
            "damaged: restore it, or start a new run directory"
        )

    try:
        digest = file_digest(path)
    except OSError as e:
        raise unreadable(e) from None
    if listed is not None and digest not in listed:
        raise CheckpointError(
            f"resume: {path} was damaged or changed after it was saved (its SHA-256 is not "
            f"the one in {side.name}); restore it, or start a new run directory"
        )
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("not a torch.save zip archive")
        if listed is None:
            _crc_check(path)
    except Exception as e:  # noqa: BLE001 (zipfile raises many kinds for one fault)
        raise unreadable(e) from None
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(SAFE_CLASSES)):
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"resume: {path} is not checkpoint data: it holds Python objects "
            f"({_globals(path, e)}) that loading would run; fedbench reads tensors and plain "
            "values only: restore the checkpoint fedbench wrote, or start a new run directory"
        ) from None
    except Exception as e:  # noqa: BLE001 (torch/zip raise many kinds for one fault)
        raise unreadable(e) from None
    try:
        if not isinstance(state, dict) or "progress" not in state or "algo" not in state:
            raise ValueError("not a fedbench checkpoint")
        int(state["progress"]["next_round"])
    except Exception as e:  # noqa: BLE001
        raise unreadable(e) from None
    if listed is None and state.get("format", 1) >= 2:
        raise CheckpointError(
            f"resume: {side} is missing, so {path} cannot be verified; restore it beside the "
            "checkpoint, or start a new run directory"
        )
    return state, digest


def load_run_state(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, str]:
    """`load_verified`, with every per-client rows manifest as `SavedRows` whose shards are
    read (and verified) from `checkpoint.rows/` beside `path` when a store loads them."""
    state, digest = load_verified(path, map_location)
    return _with_rows(state, Path(path).parent / ROWS_DIR), digest


def _shard_reader(rows_dir: Path):
    """`read(file, sha256) -> bytes` of a shard, verified; CheckpointError (one line)."""

    def read(name: str, digest: str) -> bytes:
        p = rows_dir / name
        if Path(name).name != name:
            raise CheckpointError(f"resume: {rows_dir} names a shard outside it ({name!r})")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise CheckpointError(
                f"resume: {p} cannot be read ({e.strerror or e}); the checkpoint's per-client "
                "rows are incomplete: restore the folder with its checkpoint, or start a new "
                "run directory"
            ) from None
        if _sha256(data) != digest:
            raise CheckpointError(
                f"resume: {p} was damaged or changed after it was saved (its SHA-256 is not "
                f"the one in {CHECKPOINT}); restore it, or start a new run directory"
            )
        return data

    return read


def _with_rows(x: Any, rows_dir: Path) -> Any:
    """The state with every rows manifest as `SavedRows`, read from `rows_dir` on load."""
    if isinstance(x, dict):
        if x.get(ROWS_KEY) is not None:
            return SavedRows(x, _shard_reader(rows_dir))
        for k, v in x.items():
            x[k] = _with_rows(v, rows_dir)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            x[i] = _with_rows(v, rows_dir)
    elif isinstance(x, tuple):
        return tuple(_with_rows(v, rows_dir) for v in x)
    return x


def verify_rows(state: dict, path: Path) -> None:
    """Read and verify every shard the rows of the checkpoint at `path` name
    (CheckpointError, one line)."""
    read = _shard_reader(Path(path).parent / ROWS_DIR)
    for m in _manifests(state):
        m = m.manifest if isinstance(m, SavedRows) else m
        for name, digest in m["shards"].values():
            read(str(name), str(digest))


def _globals(path: Path, err: Exception) -> str:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 (only for the message)
        names = []
    if names:
        return ", ".join(names[:4])
    line = next((ln for ln in str(err).splitlines() if "GLOBAL" in ln), "")
    return " ".join(line.split())[:120] or "refused by weights_only"


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict:
    """The checkpoint's state (`load_verified` without the digest)."""
    return load_verified(path, map_location, mmap=mmap)[0]
