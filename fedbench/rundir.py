"""A run directory belongs to one run: `claim` takes an exclusive lock on it for the run's
whole life and refuses a directory that holds another run's results unless the run resumes.

The lock is `flock` on `<dir>/.fedbench.lock` (released by the kernel when the process dies,
kill -9 included, so a crash never leaves a stale lock; flock works on local disks and on
Linux NFS clients). The file says who holds it (host, pid, start time, command), which is
what a refused second run prints.

A sweep's directory belongs to one sweep the same way (`SweepDir.claim`, the lock
`.fedbench-sweep.lock`), and runs and sweeps keep out of each other's directories:
fedbench-report stops at a run directory, so a run written over a sweep's directory (or a
sweep into a run's) would hide one of them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fedbench.errors import FedbenchError
from fedbench.io import FILE_MODE, remove_orphans

LOCK = ".fedbench.lock"
SWEEP_LOCK = ".fedbench-sweep.lock"
# Hydra writes this into a sweep's directory when the sweep starts.
MULTIRUN_FILE = "multirun.yaml"
# Files that make a directory a run's: any of them and the directory is taken.
RUN_FILES = (
    "summary.json",
    "metrics.csv",
    "clients.csv",
    "checkpoint.pt",
    "partition.json",
    ".hydra/config.yaml",
)


class RunDirError(FedbenchError):
    """The run directory is in use, taken, or cannot be written."""


def holds_run(path: Path) -> list[str]:
    """The run files `path` holds (empty: free for a new run)."""
    return [f for f in RUN_FILES if (path / f).exists()]


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return (
            f"pid {info['pid']} on {info['host']} since {info['started']} "
            f"({' '.join(info.get('argv', []))[:200]})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _os_error(path: Path, e: OSError) -> RunDirError:
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "read-only" if e.errno == errno.EROFS else "not writable"
        return RunDirError(f"run directory {path}: {why} ({e.strerror}); choose another one")
    if e.errno == errno.ENOSPC:
        return RunDirError(f"run directory {path}: no space left on the device")
    return RunDirError(f"run directory {path}: {e.strerror or e}")


# How deep `sweep_marks` looks for runs below a folder (a sweep's cells are one level down;
# `multirun/<date>/<time>/<cell>` four below the folder a user works in), and how many
# folders it looks at in all.
RUNS_BELOW_DEPTH = 4
RUNS_BELOW_FOLDERS = 5000


def sweep_marks(path: Path) -> list[str]:
    """What makes `path` a sweep's directory, or a folder of runs (empty: none): Hydra's
    multirun.yaml, a live sweep's lock, or runs in its subfolders (hidden ones skipped).
    A run written there would hide them from fedbench-report, which does not look inside
    a run's directory."""
    marks = [MULTIRUN_FILE] if (path / MULTIRUN_FILE).exists() else []
    if _held(path / SWEEP_LOCK):
        marks.append("a live sweep's lock")
    runs, seen, level = 0, 0, [path]
    for _ in range(RUNS_BELOW_DEPTH):
        below = []
        for d in level:
            with contextlib.suppress(OSError):
                below += [c for c in d.iterdir() if not c.name.startswith(".") and c.is_dir()]
        below = below[: max(RUNS_BELOW_FOLDERS - seen, 0)]
        seen += len(below)
        taken = [bool(holds_run(c)) for c in below]
        runs += sum(taken)
        level = [c for c, t in zip(below, taken, strict=True) if not t]
        if not level:
            break
    if runs:
        marks.append(f"{runs} run{'s' if runs > 1 else ''} in its subfolders")
    return marks


def run_above(path: Path) -> Path | None:
    """The nearest folder above `path` that holds a run (None: none): fedbench-report, which
    does not look inside a run's directory, would not see a run or sweep written there."""
    for p in path.absolute().parents:
        if holds_run(p):
            return p
    return None


# A file name on Linux file systems has at most 255 bytes (os.pathconf says where it can).
NAME_MAX = 255
# Room under a run directory for the longest name fedbench writes there (a temporary file of
# `.hydra/overrides.yaml`: `.overrides.yaml.<8 random>.tmp`).
ROOM = 64


def check_name_length(path: Path, what: str = "run directory") -> None:
    """Raise RunDirError (one line) when a folder name of `path` has more bytes than its
    file system allows, or the whole path would be too long for the files in it."""
    p = path.absolute()
    known = p
    while not os.path.exists(known):  # (Path.exists raises on a name too long)
        known = known.parent
    try:
        name_max = os.pathconf(known, "PC_NAME_MAX")
        path_max = os.pathconf(known, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = NAME_MAX, 4096
    for part in p.parts[1:]:
        n = len(os.fsencode(part))
        if n > name_max:
            raise RunDirError(
                f"{what} {_short(str(p))}: the folder name {_short(part, 30)} has {n} bytes, "
                f"more than the {name_max} a file name may have here; choose a shorter one"
            )
    if len(os.fsencode(str(p))) + ROOM > path_max:
        raise RunDirError(
            f"{what} {_short(str(p))}: the path has {len(os.fsencode(str(p)))} bytes, too long "
            f"for the files in it (at most {path_max - ROOM}); choose a shorter one"
        )


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def check_writable(path: Path, what: str = "run directory") -> None:
    """Raise RunDirError unless `path` exists as a directory we may write, or can be made
    (its nearest existing ancestor is a writable directory, every name fits the file
    system). Writes nothing."""
    check_name_length(path, what)
    p = path.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise RunDirError(f"{what} {path}: {p} is a file, not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        ro = os.statvfs(p).f_flag & os.ST_RDONLY
        why = "is on a read-only file system" if ro else "is not writable"
        raise RunDirError(f"{what} {path}: {p} {why}; choose another one")


@dataclass
class RunDir:
    """A claimed run directory; `release()` (or leaving the `with` block) gives it up."""

    path: Path
    fd: int

    @classmethod
    def claim(cls, path: str | os.PathLike, *, resume: bool) -> RunDir:
        """Lock `path` (made if missing) for this process, or raise RunDirError (one line):
        another live process holds it, or it holds another run's results and `resume` is
        false. Removes what killed atomic writes left (`.*.tmp`) once the lock is held."""
        path = Path(path)
        check_writable(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(path, e) from e
        lock = path / LOCK
        fd = _lock(path, lock, "run directory", "run")
        taken = holds_run(path)
        if taken and not resume:
            _unlock(fd, lock)
            raise RunDirError(
                f"run directory {path} holds another run ({', '.join(taken)}); resume=true to "
                "continue that run, or choose another directory"
            )
        sweep = sweep_marks(path)
        if sweep:
            _unlock(fd, lock)
            raise RunDirError(
                f"run directory {path} holds a sweep or other runs ({', '.join(sweep)}); a run "
                "there would hide them from fedbench-report: choose another one"
            )
        remove_orphans(path)
        if (path / ".hydra").is_dir():
            remove_orphans(path / ".hydra")
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            _unlock(self.fd, self.path / LOCK)
            self.fd = -1

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class SweepDir:
    """A claimed sweep directory: one sweep at a time writes its jobs there (a second
    sweep started into it would find the first one's jobs taken and report them as
    failed). `release()` (or leaving the `with` block) gives it up."""

    path: Path
    fd: int

    @classmethod
    def claim(cls, path: str | os.PathLike) -> SweepDir:
        """Lock `path` (made if missing) for this sweep, or raise RunDirError (one line):
        another live sweep holds it, or it holds a run's files."""
        path = Path(path)
        check_writable(path, "sweep directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(path, e) from e
        lock = path / SWEEP_LOCK
        fd = _lock(path, lock, "sweep directory", "sweep")
        taken = holds_run(path) or (["a live run's lock"] if _held(path / LOCK) else [])
        if taken:
            _unlock(fd, lock)
            raise RunDirError(
                f"sweep directory {path} holds a run ({', '.join(taken)}); the sweep's runs "
                "would be hidden from fedbench-report there: choose another hydra.sweep.dir"
            )
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            _unlock(self.fd, self.path / SWEEP_LOCK)
            self.fd = -1

    def __enter__(self) -> SweepDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(path: Path, lock: Path, what: str, whose: str) -> int:
    """flock `lock` (made if missing) without waiting; its file descriptor, holding a note
    of who holds it. RunDirError (one line) when another process holds it."""
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as e:
            raise _os_error(path, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"{what} {path} is in use by {_holder(lock)}; wait for that {whose} or "
                "choose another directory"
            ) from None
        except OSError as e:
            os.close(fd)
            raise _os_error(path, e) from e
        # The holder unlinks the file before it lets go: make sure we locked the file
        # that is there now, not one a finished run just removed.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:  # pragma: no cover (a lock file replaced 100 times in a row)
        raise RunDirError(f"{what} {path}: could not take its lock {lock}")
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:
        pass  # the lock holds without its note (a full disk): only the message is vaguer
    return fd


def _held(lock: Path) -> bool:
    """Whether a live process holds `lock` (a lock file left by kill -9 is not held)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (closing it lets go of the probe's shared lock)
    return False


def _unlock(fd: int, lock: Path) -> None:
    # Unlink while still holding the lock, so a waiting claimant re-checks (see claim).
    with contextlib.suppress(OSError):
        lock.unlink(missing_ok=True)
    os.close(fd)
