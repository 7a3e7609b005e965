"""Writes that lose nothing: a killed run or a full disk leaves the previous complete file or
none, never half a file; files are readable by collaborators (0666 less the umask, as any
file the user creates, not mkstemp's 0600)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from fedbench.errors import FedbenchError

TMP_SUFFIX = ".tmp"


def _umask() -> int:
    # Read once at import (os.umask can only be read by setting it; single-threaded here).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


class WriteError(FedbenchError):
    """A result file could not be written (disk full, read-only, no permission)."""

    def __init__(self, path: str | os.PathLike, err: OSError) -> None:
        self.path = Path(path)
        self.errno = err.errno
        super().__init__(
            f"cannot write {self.path}: {err.strerror or err} (the files already there are intact)"
        )


class _Recording:
    """A binary file that remembers the OSError of a failed write: torch.save reports a full
    disk as a RuntimeError of its own, and the cause should reach the user."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[IO[bytes]], Any],
    before_replace: Callable[[], None] | None = None,
) -> int:
    """Write `path` by `write(f)` into a temporary file beside it, then rename it into place;
    returns the bytes written. On any failure the temporary file is removed and `path` is
    untouched; a failed write to the disk becomes WriteError (one line). `before_replace()`
    runs once the new content is on disk, before the rename (a checkpoint announces its
    digest there: fedbench/checkpoint.py)."""
    path = Path(path)
    tmp = None
    rec = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            rec = _Recording(f)
            write(rec)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        tmp = None
        return size
    except OSError as e:
        raise WriteError(path, e) from e
    except Exception as e:
        if rec is not None and rec.error is not None:
            raise WriteError(path, rec.error) from e
        raise
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def remove_orphans(folder: Path) -> list[Path]:
    """Remove the temporary files a killed atomic write left in `folder` (call only while
    holding the folder's run lock: a live writer's temporary file would go too)."""
    gone = []
    for p in folder.glob(f".*{TMP_SUFFIX}"):
        if p.is_file():
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def _cell(v: Any) -> str:
    """A value as pandas' to_csv writes it: floats in their shortest round-trip form, NaN
    and None empty."""
    if v is None:
        return ""
    if isinstance(v, float):  # numpy floats too
        v = float(v)
        return "" if v != v else repr(v)
    if hasattr(v, "item"):  # numpy integers and booleans
        v = v.item()
    return str(v)


class CsvAppender:
    """A CSV file that grows by appended rows (cost per row, not per file). The header is
    the first rows' keys; a row with a key the header lacks rewrites the file once with the
    wider header (earlier rows empty there). `length` is the file's size after the last
    complete write, which a checkpoint records so that a resume can cut the file back."""

    def __init__(self, path: Path, header: Sequence[str] | None = None, length: int = 0) -> None:
        self.path = path
        self.header = list(header) if header else None
        self.length = length

    @staticmethod
    def _text(header: Sequence[str], rows: Iterable[dict], with_header: bool) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if with_header:
            w.writerow(header)
        for r in rows:
            w.writerow([_cell(r.get(k)) for k in header])
        return buf.getvalue()

    def append(self, rows: list[dict]) -> None:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        if self.header is None or self.length == 0:
            self.header = list(dict.fromkeys([*(self.header or []), *keys]))
            self._rewrite([], rows)
            return
        new = [k for k in keys if k not in self.header]
        if new:
            with open(self.path, newline="") as f:
                old = list(csv.DictReader(f))
            self.header = [*self.header, *new]
            self._rewrite(old, rows)
            return
        data = self._text(self.header, rows, with_header=False).encode()
        try:
            with open(self.path, "r+b") as f:
                f.seek(self.length)
                f.truncate()  # anything after the last complete write (a killed append)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            _truncate(self.path, self.length)  # a partial row must not stay (disk full)
            raise WriteError(self.path, e) from e
        self.length += len(data)

    def _rewrite(self, old: list[dict], rows: list[dict]) -> None:
        text = self._text(self.header, [*old, *rows], with_header=True)
        self.length = atomic_write(self.path, lambda f: f.write(text.encode()))


def _truncate(path: Path, length: int) -> None:
    with contextlib.suppress(OSError):
        os.truncate(path, length)
