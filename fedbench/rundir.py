"""A run directory belongs to one run: `claim` takes an exclusive lock on it for the run's
whole life and refuses a directory that holds another run's results unless the run resumes.

The lock is `flock` on `<dir>/.fedbench.lock` (released by the kernel when the process dies,
kill -9 included, so a crash never leaves a stale lock; flock works on local disks and on
Linux NFS clients). The file says who holds it (host, pid, start time, command), which is
what a refused second run prints.
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


def check_writable(path: Path) -> None:
    """Raise RunDirError unless `path` exists as a directory we may write, or can be made
    (its nearest existing ancestor is a writable directory). Writes nothing."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise RunDirError(f"run directory {path}: {p} is a file, not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        ro = os.statvfs(p).f_flag & os.ST_RDONLY
        why = "is on a read-only file system" if ro else "is not writable"
        raise RunDirError(f"run directory {path}: {p} {why}; choose another one")


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
                    f"run directory {path} is in use by {_holder(lock)}; wait for that run or "
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
            raise RunDirError(f"run directory {path}: could not take its lock {lock}")
        taken = holds_run(path)
        if taken and not resume:
            _unlock(fd, lock)
            raise RunDirError(
                f"run directory {path} holds another run ({', '.join(taken)}); resume=true to "
                "continue that run, or choose another directory"
            )
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


def _unlock(fd: int, lock: Path) -> None:
    # Unlink while still holding the lock, so a waiting claimant re-checks (see claim).
    with contextlib.suppress(OSError):
        lock.unlink(missing_ok=True)
    os.close(fd)
