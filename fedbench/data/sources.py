"""Dataset loaders behind one registry: raw files on disk -> in-memory tensors.

Each loader reads its dataset's own on-disk format directly (IDX, CIFAR pickles, a JPEG
folder, an npz); torchvision / medmnist are used only to download missing files. Decoded
image datasets are cached in the user's cache folder (``cache_dir()``), one file per dataset
and data root, so later runs skip the decode; the cache remembers what the raw files held
(sizes and content hashes) and is rebuilt when they change, whatever their timestamps say.
Nothing is ever written beside the raw files (they may be a system package's). A missing,
truncated or corrupt dataset file is a one-line ``DataError`` naming the file and how to get
it again, never a traceback from deep inside a decoder or a download library; a corrupt cache
is only a warning (it is rebuilt).
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import logging
import math
import os
import pickle
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedbench.errors import ConfigError, DataError, FedbenchError
from fedbench.registry import Registry

__all__ = ["DATASETS", "Dataset", "dataset_names", "load_dataset"]

Tensors = dict[str, torch.Tensor]
Loader = Callable[..., "Dataset"]

DATASETS: Registry[Loader] = Registry("dataset")
log = logging.getLogger(__name__)

# Where the Debian package `dataset-fashion-mnist` puts the files; module-level so tests
# can point it elsewhere.
FMNIST_SYSTEM_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets/fashion-mnist"),)
FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
CACHE_ENV = "FEDBENCH_CACHE"
_CACHE_FORMAT = 3  # bump when the cache's layout changes (2: fingerprints, checksums; 3: root)
_SPLITS = ("x_train", "y_train", "x_test", "y_test")
# A source whose mtime is this close to the moment it was fingerprinted (or in the future)
# may still be written within the same timestamp tick without its size changing (Git's
# "racy" entries; FAT stamps are 2 s coarse): its stamp is not trusted, it is re-hashed.
_RACY_NS = 2_000_000_000


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor  # uint8 [N, C, H, W] for images; float32 [N, D] for synthetic
    y_train: torch.Tensor  # int64 [N]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # per-channel normalization constants in [0, 1] scale
    std: tuple[float, ...]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def digest(self) -> str:
        """SHA-256 (hex) of what a run trains and tests on: the four tensors' dtypes, shapes
        and bytes. The same content gives the same digest wherever its files lie (a moved
        copy, the Debian package, the cache); other files of the same shape do not."""
        h = hashlib.sha256()
        for t in (self.x_train, self.y_train, self.x_test, self.y_test):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
        return h.hexdigest()


def default_root() -> Path:
    """``$FEDBENCH_DATA`` if set, else ``~/.cache/fedbench``."""
    env = os.environ.get("FEDBENCH_DATA")
    return Path(env if env else "~/.cache/fedbench").expanduser()


def load_dataset(
    name: str, root: str | os.PathLike | None, download: bool = True, **params
) -> Dataset:
    """Load dataset ``name`` from ``root`` (None: ``default_root()``), downloading if allowed."""
    fn = DATASETS.get(name)
    root_path = Path(root).expanduser() if root is not None else default_root()
    try:
        inspect.signature(fn).bind(root_path, download, **params)
    except TypeError:
        # A typo in a config key should name the valid keys, not show a TypeError.
        valid = [p for p in inspect.signature(fn).parameters if p not in ("root", "download")]
        raise ConfigError(
            f"dataset {name!r} got unknown parameter(s) {sorted(params)}; valid: {valid}"
        ) from None
    try:
        if root_path.exists() and not root_path.is_dir():
            # Searched as a folder, a file would just be skipped: FMNIST would quietly come
            # from /usr/share, a download would fail on mkdir.
            what = "data.root" if root is not None else "the data root ($FEDBENCH_DATA)"
            raise DataError(f"{what}={root_path} is a file, not a directory")
        return fn(root_path, download, **params)
    except OSError as e:
        # What the loaders do not name themselves: a folder we may not list, a full disk...
        where = e.filename if e.filename is not None else root_path
        raise DataError(_one_line(f"dataset {name!r}: cannot read {where}: {_reason(e)}")) from None


def dataset_names() -> list[str]:
    return DATASETS.names()


# ---------------------------------------------------------------------------- helpers


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _reason(e: BaseException, limit: int = 200) -> str:
    text = _one_line(e.strerror if isinstance(e, OSError) and e.strerror else e)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _missing(name: str, searched: Sequence[Path], how: str, cause: str = "") -> DataError:
    where = ", ".join(str(p) for p in searched)
    msg = f"dataset {name!r} not found (searched: {where})"
    if cause:
        msg += f"; download failed: {cause}"
    return DataError(_one_line(f"{msg}; {how}"))


def _download(
    name: str,
    searched: Sequence[Path],
    how: str,
    fetch: Callable[[], object],
    archives: Sequence[Path] = (),
) -> None:
    """Run a library download, turning any failure into our one-line DataError.

    ``archives``: where the library keeps what it downloads; one left behind by a failed
    download may be a partial or corrupt file the library keeps tripping over (torchvision
    re-extracts, or reports "File not found or corrupted"), so the message names it.
    """
    try:
        fetch()
    except Exception as e:  # network, checksum, disk, a bad archive: all mean "not available"
        cause = f"{type(e).__name__}: {_reason(e)}"
        left = [str(a) for a in archives if a.is_file()]
        if left:
            them = "it" if len(left) == 1 else "them"
            cause += f" ({', '.join(left)} may be truncated or corrupt: delete {them} and retry)"
        raise _missing(name, searched, how, cause) from None


def _bad_file(path: Path, problem: str, fix: str) -> DataError:
    return DataError(_one_line(f"{path}: {problem}; {fix}"))


@contextmanager
def _reading(path: Path, what: str, fix: str) -> Iterator[None]:
    """Make whatever reading and decoding ``path`` raises one DataError naming the file.

    Decoders fed truncated or foreign bytes raise nearly anything: EOFError, zlib.error and
    gzip.BadGzipFile from gzip, zipfile.BadZipFile from npz, UnpicklingError but also
    AttributeError, ImportError, IndexError... from pickle (as its docs warn), SyntaxError
    and ValueError from PIL's parsers, ValueError/KeyError from wrong contents. Each means
    the same here, so everything raised inside the block is caught; keep the blocks narrow.
    """
    try:
        yield
    except FedbenchError:
        raise
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None:  # the OS's, not a decoder's
            if isinstance(e, PermissionError):
                fix = "make it readable (check its permissions)"
            raise _bad_file(path, f"cannot be read ({_reason(e)})", fix) from None
        problem = f"truncated, corrupt or not {what} ({type(e).__name__}: {_reason(e)})"
        raise _bad_file(path, problem, fix) from None


def _check_labels(path: Path, y: np.ndarray | torch.Tensor, num_classes: int, fix: str) -> None:
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        problem = (
            f"labels span {int(y.min())}..{int(y.max())}, expected 0..{num_classes - 1} "
            "(corrupt, or another dataset's file)"
        )
        raise _bad_file(path, problem, fix)


# ------------------------------------------------------------------------------ cache
#
# ``cache_file(name, root)`` holds the decoded tensors, a CRC-32 of each (torch.load
# checks no checksum: a flipped byte would go unnoticed) and a fingerprint of the raw sources
# it was decoded from: per source its path, a cheap stamp and a SHA-256 of its content. A
# file's stamp is (size, mtime_ns); a folder's (TinyImageNet's image folders) is its file
# count and a digest of its files' (name, size, mtime_ns), its content hash one over its
# files' names and bytes. On load a source whose stamp is unchanged is trusted without
# reading it; one whose stamp differs in any way (an older mtime too: tar, cp -p, rsync -a
# keep the source's) is re-hashed, and the cache is rebuilt if the content differs, or
# kept with the new stamps if not. What this cannot see: a file (or an image in a folder)
# replaced by one of the same name and size carrying exactly the same mtime_ns.
#
# The cache lives in the user's cache folder, never beside the raw files: a data root may be
# read-only or a system package's (/usr/share/datasets/fashion-mnist, where a root user's run
# would otherwise leave files dpkg does not know). Its file is named by the dataset and a
# digest of the data root's absolute path, and records that path, so two data roots never
# share an entry. A cache folder that cannot be created, read or written costs the decode,
# never the run: one warning per folder, then the run goes on without the cache.

_unusable: set[str] = set()  # cache folders already warned about


def cache_dir() -> Path:
    """``$FEDBENCH_CACHE`` if set, else ``$XDG_CACHE_HOME/fedbench/cache``, else
    ``~/.cache/fedbench/cache``. Raises RuntimeError when no home folder can be found."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path("~/.cache").expanduser()
    return base / "fedbench" / "cache"


def cache_file(name: str, root: Path) -> Path:
    """The cache of dataset ``name`` loaded from data root ``root``."""
    key = hashlib.sha256(os.fsencode(_root_key(root))).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.pt"


def _root_key(root: Path) -> str:
    return str(Path(os.path.abspath(root)))


def _cache_unusable(where: object, e: BaseException) -> None:
    key = str(where)
    if key not in _unusable:
        _unusable.add(key)
        log.warning(
            "dataset cache %s unusable (%s); going on without it (set $%s to another folder)",
            where,
            _one_line(_reason(e)),
            CACHE_ENV,
        )


def _file_digest(path: Path, buf: bytearray | None = None) -> bytes:
    h = hashlib.sha256()
    view = memoryview(buf if buf is not None else bytearray(1 << 20))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.digest()


def _folder_files(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return sorted((e for e in it if e.is_file()), key=lambda e: e.name)


def _stamp(path: Path) -> tuple[tuple, int]:
    """(the source's stamp, its newest mtime_ns); see the comment above."""
    if path.is_dir():
        h, newest = hashlib.sha256(), 0
        files = _folder_files(path)
        for e in files:
            st = e.stat()
            h.update(b"%s\0%d\0%d\n" % (os.fsencode(e.name), st.st_size, st.st_mtime_ns))
            newest = max(newest, st.st_mtime_ns)
        return ("folder", len(files), h.hexdigest()), newest
    st = path.stat()
    return ("file", st.st_size, st.st_mtime_ns), st.st_mtime_ns


def _digest(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files' names and bytes."""
    if not path.is_dir():
        return _file_digest(path).hex()
    h, buf = hashlib.sha256(), bytearray(1 << 20)
    for e in _folder_files(path):
        h.update(os.fsencode(e.name) + b"\0" + _file_digest(Path(e.path), buf))
    return h.hexdigest()


def _source(path: Path, stamp: tuple, newest: int, digest: str) -> dict:
    racy = newest >= time.time_ns() - _RACY_NS
    return {"path": str(path), "stamp": None if racy else stamp, "hash": digest}


def _fingerprint(raw: Sequence[Path], fix: str) -> list[dict]:
    out = []
    for p in raw:
        with _reading(p, "a readable file", fix):
            stamp, newest = _stamp(p)  # before reading: a write after it changes the stamp
            out.append(_source(p, stamp, newest, _digest(p)))
    return out


def _refresh(stored: object, raw: Sequence[Path]) -> list[dict] | None:
    """The stored fingerprint brought up to date if every source still holds what it did
    when the cache was built (re-hashing only sources whose path or stamp changed), else None.
    """
    if not isinstance(stored, list) or len(stored) != len(raw):
        return None
    fresh = []
    try:
        for entry, p in zip(stored, raw):
            stamp, newest = _stamp(p)
            if entry["stamp"] is not None and (entry["path"], entry["stamp"]) == (str(p), stamp):
                fresh.append(entry)
            elif _digest(p) == entry["hash"]:
                fresh.append(_source(p, stamp, newest, entry["hash"]))
            else:
                log.info("%s changed since the dataset cache was built; decoding again", p)
                return None
    except (OSError, KeyError, TypeError):  # vanished meanwhile, or a malformed entry
        return None
    return fresh


def _crcs(tensors: Tensors) -> dict[str, int]:
    return {
        k: zlib.crc32(t.contiguous().reshape(-1).numpy().view(np.uint8)) for k, t in tensors.items()
    }


def _read_cache(cache: Path, keys: Sequence[str], root: Path) -> dict | None:
    """The cache's blob if it is a sound one of this format for data root ``root``, else
    None, with a warning if it is damaged: it is never the user's data, so it is rebuilt,
    never an error."""
    try:
        if not cache.is_file():
            return None
    except OSError as e:  # a cache folder we may not search
        _cache_unusable(cache.parent, e)
        return None
    try:
        blob = torch.load(cache, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != _CACHE_FORMAT:
            log.info("%s is from another fedbench version; rebuilding it", cache)
            return None
        if blob.get("root") != _root_key(root):  # another data root's (a digest collision)
            return None
        t = blob["tensors"]
        if not set(keys) <= set(t) or not all(isinstance(v, torch.Tensor) for v in t.values()):
            problem = f"it holds {sorted(t)}, not {sorted(keys)}"
        elif blob["crc"] != _crcs(t):
            problem = "corrupt (its checksums do not match)"
        else:
            return blob
    except Exception as e:  # truncated, corrupt or foreign: torch and pickle raise many kinds
        problem = f"unreadable ({type(e).__name__}: {_reason(e)})"
    log.warning("ignoring the dataset cache %s: %s; rebuilding it", cache, _one_line(problem))
    return None


def _cached(
    name: str,
    root: Path,
    raw: Sequence[Path] | None,
    decode: Callable[[], Tensors],
    fix: str,
    keys: Sequence[str] = _SPLITS,
) -> Tensors | None:
    """Tensors from the cache if ``raw`` still holds what it was built from, else
    ``decode()`` them and cache them. ``fix``: how to repair an unreadable raw file.

    ``raw=None`` means the raw files were not found: use any cache there is, or return None.
    """
    try:
        cache = cache_file(name, root)
    except RuntimeError as e:  # no home folder to put a cache in
        _cache_unusable("(no cache folder)", e)
        cache = None
    blob = _read_cache(cache, keys, root) if cache is not None else None
    if raw is None:
        return blob["tensors"] if blob is not None else None
    if blob is not None:
        fresh = _refresh(blob.get("sources"), raw)
        if fresh is not None:
            if fresh != blob["sources"]:  # same content, new stamps: no re-hash next time
                _write_cache(cache, root, blob["tensors"], fresh)
            return blob["tensors"]
    sources = _fingerprint(raw, fix)
    tensors = decode()
    if cache is not None:
        _write_cache(cache, root, tensors, sources)
    return tensors


def _write_cache(cache: Path, root: Path, tensors: Tensors, sources: list[dict]) -> None:
    # Atomic (temp file + os.replace) so a killed run or a parallel run never leaves a
    # half-written cache; an unusable cache folder just means no cache (one warning).
    tmp = None
    blob = {
        "format": _CACHE_FORMAT,
        "root": _root_key(root),
        "sources": sources,
        "crc": _crcs(tensors),
        "tensors": tensors,
    }
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.stem}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache wants readable
        os.replace(tmp, cache)
    except (OSError, RuntimeError) as e:  # torch reports some write failures as RuntimeError
        _cache_unusable(cache.parent, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _make(
    name: str,
    t: Tensors,
    num_classes: int,
    shape: tuple[int, ...],
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
    """Build a Dataset, checking the decoded files really are this dataset."""
    for split in ("train", "test"):
        x, y = t[f"x_{split}"], t[f"y_{split}"]
        if tuple(x.shape[1:]) != shape or len(x) != len(y):
            raise DataError(
                f"dataset {name!r}: {split} images have shape {tuple(x.shape)} with {len(y)} "
                f"labels, expected [N, {', '.join(map(str, shape))}]; the files are not {name}"
            )
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise DataError(
                f"dataset {name!r}: {split} labels span {int(y.min())}..{int(y.max())}, "
                f"expected 0..{num_classes - 1}; the files are not {name}"
            )
    return Dataset(
        name, t["x_train"], t["y_train"], t["x_test"], t["y_test"], num_classes, mean, std
    )


def _labels(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64).reshape(-1))


# ----------------------------------------------------------------------- fashion-mnist


def _idx_file(folder: Path, base: str) -> Path | None:
    for cand in (folder / base, folder / f"{base}.gz"):
        if cand.is_file():
            return cand
    return None


def _fmnist_fix(path: Path) -> str:
    if any(path.is_relative_to(d) for d in FMNIST_SYSTEM_DIRS):
        return "reinstall the Debian package: apt-get install --reinstall dataset-fashion-mnist"
    return (
        "delete it, then load again with data.download=true to re-download it or install the "
        "Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)"
    )


def _read_idx(path: Path, fix: str) -> np.ndarray:
    """Decode an IDX file (optionally gzipped) of unsigned bytes."""
    with _reading(path, "a (gzipped) IDX file", fix):
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise _bad_file(path, "not an IDX file of unsigned bytes (bad magic number)", fix)
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise _bad_file(
            path, f"truncated: {len(data)} bytes, its IDX header alone is {header}", fix
        )
    dims = struct.unpack(f">{ndim}I", data[4:header])
    want, have = math.prod(dims), len(data) - header
    if have != want:
        problem = "truncated" if have < want else "corrupt"
        raise _bad_file(
            path, f"{problem}: its IDX header says {dims} ({want} bytes) but it holds {have}", fix
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


@DATASETS.register("fmnist")
def load_fmnist(root: Path, download: bool) -> Dataset:
    name = "fmnist"
    dirs = [root, root / "fashion-mnist", root / "FashionMNIST" / "raw", *FMNIST_SYSTEM_DIRS]

    def find() -> list[Path] | None:
        for d in dirs:
            files = [_idx_file(d, base) for base in FMNIST_FILES]
            if all(files):
                return files  # type: ignore[return-value]
        return None

    def decode(files: list[Path]) -> Tensors:
        out: Tensors = {}
        for split, fx, fy in (("train", *files[:2]), ("test", *files[2:])):
            x, y = _read_idx(fx, _fmnist_fix(fx)), _read_idx(fy, _fmnist_fix(fy))
            if x.ndim != 3 or x.shape[1:] != (28, 28):
                problem = f"holds an array of shape {x.shape}, not 28x28 images"
                raise _bad_file(fx, problem, _fmnist_fix(fx))
            if y.ndim != 1:
                raise _bad_file(
                    fy, f"holds an array of shape {y.shape}, not labels", _fmnist_fix(fy)
                )
            if len(x) != len(y):
                problem = f"holds {len(y)} labels but {fx} holds {len(x)} images"
                raise _bad_file(fy, problem, _fmnist_fix(fy))
            _check_labels(fy, y, 10, _fmnist_fix(fy))
            out[f"x_{split}"] = torch.from_numpy(x.copy()).unsqueeze(1)
            out[f"y_{split}"] = _labels(y)
        return out

    how = (
        "apt-get install dataset-fashion-mnist, or set data.root to a folder with the four "
        "idx files"
    )
    files = find()
    fix = _fmnist_fix(files[0]) if files else ""
    t = _cached(name, root, files, lambda: decode(files), fix)
    if t is None:
        if not download:
            raise _missing(name, dirs, how)

        def fetch() -> None:
            from torchvision.datasets import FashionMNIST

            root.mkdir(parents=True, exist_ok=True)
            FashionMNIST(str(root), download=True)

        _download(name, dirs, how, fetch)  # torchvision checks its .gz files' MD5 itself
        files = find()
        if files is None:
            raise _missing(name, dirs, how, "torchvision left no idx files")
        t = _cached(name, root, files, lambda: decode(files), _fmnist_fix(files[0]))
    return _make(name, t, 10, (1, 28, 28), (0.2860,), (0.3530,))


# ----------------------------------------------------------------------------- CIFAR


def _unpickle(path: Path) -> dict:
    with path.open("rb") as f:
        d = pickle.load(f, encoding="latin1")  # the official files are Python 2 pickles
    # Python 2 pickles give str keys under latin1; files written by Python 3 keep bytes keys.
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def _cifar(
    name: str,
    root: Path,
    download: bool,
    folder: str,
    train: Sequence[str],
    test: str,
    label_key: str,
    num_classes: int,
    tv_class: str,
    url: str,
) -> Tensors:
    d = root / folder
    how = (
        f"allow downloading on a machine with network, or unpack {url} into data.root so {d} exists"
    )
    fix = (
        f"delete it and load again with data.download=true to re-fetch {folder}, or unpack "
        f"{url} into data.root again"
    )

    def find() -> list[Path] | None:
        files = [d / f for f in (*train, test)]
        return files if all(f.is_file() for f in files) else None

    def decode(files: list[Path]) -> Tensors:
        out: Tensors = {}
        for split, parts in (("train", files[:-1]), ("test", files[-1:])):
            xs, ys = [], []
            for p in parts:
                with _reading(p, f"a {name} batch", fix):
                    b = _unpickle(p)
                    x = np.asarray(b["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                    y = _labels(b[label_key])
                if len(x) != len(y):
                    raise _bad_file(p, f"holds {len(x)} images but {len(y)} labels", fix)
                _check_labels(p, y, num_classes, fix)
                xs.append(x)
                ys.append(y)
            out[f"x_{split}"] = torch.from_numpy(np.concatenate(xs))
            out[f"y_{split}"] = torch.cat(ys)
        return out

    files = find()
    t = _cached(name, root, files, lambda: decode(files), fix)
    if t is None:
        if not download:
            raise _missing(name, [d], how)

        def fetch() -> None:
            import torchvision.datasets as tvd

            root.mkdir(parents=True, exist_ok=True)
            getattr(tvd, tv_class)(str(root), download=True)

        _download(name, [d], how, fetch, [root / url.rsplit("/", 1)[-1]])
        files = find()
        if files is None:
            raise _missing(name, [d], how, f"torchvision left no {folder}")
        t = _cached(name, root, files, lambda: decode(files), fix)
    return t


@DATASETS.register("cifar10")
def load_cifar10(root: Path, download: bool) -> Dataset:
    t = _cifar(
        "cifar10",
        root,
        download,
        folder="cifar-10-batches-py",
        train=[f"data_batch_{i}" for i in range(1, 6)],
        test="test_batch",
        label_key="labels",
        num_classes=10,
        tv_class="CIFAR10",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    )
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    return _make("cifar10", t, 10, (3, 32, 32), mean, std)


@DATASETS.register("cifar100")
def load_cifar100(root: Path, download: bool) -> Dataset:
    t = _cifar(
        "cifar100",
        root,
        download,
        folder="cifar-100-python",
        train=["train"],
        test="test",
        label_key="fine_labels",
        num_classes=100,
        tv_class="CIFAR100",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    )
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    return _make("cifar100", t, 100, (3, 32, 32), mean, std)


# ---------------------------------------------------------------------- tiny-imagenet


def _read_rgb(path: Path, fix: str) -> np.ndarray:
    with _reading(path, "an image", fix), Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def _read_images(paths: Sequence[Path], size: int, fix: str) -> torch.Tensor:
    """Decode images into one uint8 [N, 3, size, size] tensor; threads since PIL drops the GIL."""
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)

    def put(i: int) -> None:
        img = _read_rgb(paths[i], fix)
        if img.shape != (size, size, 3):
            raise _bad_file(paths[i], f"image is {img.shape[1]}x{img.shape[0]}, not {size}", fix)
        out[i] = img

    ex = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    try:
        list(ex.map(put, range(len(paths))))
    finally:  # on a bad image, do not decode the other 100k first
        ex.shutdown(wait=True, cancel_futures=True)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(root: Path, download: bool) -> Dataset:
    name = "tinyimagenet"
    d = root / "tiny-imagenet-200"
    how = f"no automatic download: get {TINYIMAGENET_URL} and unzip it into data.root so {d} exists"
    fix = f"unzip {TINYIMAGENET_URL} into data.root again (replacing {d})"

    def sources() -> list[Path] | None:
        # The index files and the image folders (fingerprinted per folder, see _stamp).
        if not (d / "wnids.txt").is_file() or not (d / "train").is_dir():
            return None
        found = [d / "wnids.txt", d / "val" / "val_annotations.txt", d / "val" / "images"]
        found += sorted(p / "images" for p in (d / "train").iterdir() if (p / "images").is_dir())
        return [p for p in found if p.exists()]

    def read_lines(path: Path) -> list[str]:
        with _reading(path, "a text file", fix):
            return path.read_text(encoding="utf-8").splitlines()

    def decode() -> Tensors:
        wnids_txt = d / "wnids.txt"
        wnids = sorted({w for line in read_lines(wnids_txt) for w in line.split()})
        if len(wnids) > 200:
            raise _bad_file(wnids_txt, f"lists {len(wnids)} classes, not 200", fix)
        index = {w: i for i, w in enumerate(wnids)}
        train_paths, train_labels = [], []
        for w in wnids:
            imgs = sorted(
                p for p in (d / "train" / w / "images").glob("*") if p.suffix.lower() == ".jpeg"
            )
            if not imgs:
                problem = f"lists class {w!r} but {d / 'train' / w / 'images'} has no images"
                raise _bad_file(wnids_txt, problem, fix)
            train_paths += imgs
            train_labels += [index[w]] * len(imgs)
        ann = d / "val" / "val_annotations.txt"
        if not ann.is_file():
            raise DataError(f"dataset {name!r}: {ann} is missing; re-unzip {TINYIMAGENET_URL}")
        val_paths, val_labels = [], []
        for n, line in enumerate(read_lines(ann), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2:
                problem = f"line {n} is not '<image>\\t<wnid>\\t...' (truncated or corrupt)"
                raise _bad_file(ann, problem, fix)
            fname, wnid = fields[:2]
            if wnid not in index:
                raise _bad_file(ann, f"line {n} names class {wnid!r} not in wnids.txt", fix)
            val_paths.append(d / "val" / "images" / fname)
            val_labels.append(index[wnid])
        return {
            "x_train": _read_images(train_paths, 64, fix),
            "y_train": _labels(train_labels),
            "x_test": _read_images(val_paths, 64, fix),
            "y_test": _labels(val_labels),
        }

    t = _cached(name, root, sources(), decode, fix)
    if t is None:
        raise _missing(name, [d], how)
    mean, std = (0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)
    return _make(name, t, 200, (3, 64, 64), mean, std)


# -------------------------------------------------------------------------- pathmnist


@DATASETS.register("pathmnist")
def load_pathmnist(root: Path, download: bool, use_val: bool = False) -> Dataset:
    name = "pathmnist"
    f = root / "pathmnist.npz"
    url = "https://zenodo.org/records/10519652/files/pathmnist.npz"
    how = f"pip install medmnist and allow downloading, or save {url} as {f}"
    fix = (
        "delete it and load again with data.download=true (needs pip install medmnist) to "
        f"re-download it, or save {url} as {f} again"
    )
    keys = [f"{xy}_{split}" for split in ("train", "val", "test") for xy in "xy"]

    def decode() -> Tensors:
        # The three splits are cached separately so `use_val` needs no second cache.
        out: Tensors = {}
        with _reading(f, "a MedMNIST npz archive", fix), f.open("rb") as fh:
            if fh.read(4) != b"PK\x03\x04":  # else np.load suggests allow_pickle=True
                raise _bad_file(f, "not an npz archive (no zip header)", fix)
        with _reading(f, "a MedMNIST npz archive", fix), np.load(f) as z:
            for split in ("train", "val", "test"):
                x = np.asarray(z[f"{split}_images"], dtype=np.uint8)
                y = _labels(z[f"{split}_labels"])
                if x.shape[1:] != (28, 28, 3) or len(x) != len(y):
                    problem = (
                        f"its {split} split holds images of shape {x.shape} and {len(y)} "
                        "labels, not [N, 28, 28, 3] and N (not PathMNIST)"
                    )
                    raise _bad_file(f, problem, fix)
                _check_labels(f, y, 9, fix)
                out[f"x_{split}"] = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
                out[f"y_{split}"] = y
        return out

    t = _cached(name, root, [f] if f.is_file() else None, decode, fix, keys)
    if t is None:
        if not download:
            raise _missing(name, [f], how)
        try:
            import medmnist
        except ImportError:
            raise _missing(name, [f], how, "the medmnist package is not installed") from None

        def fetch() -> None:
            root.mkdir(parents=True, exist_ok=True)
            medmnist.PathMNIST(split="test", download=True, root=str(root))

        _download(name, [f], how, fetch, [f])
        if not f.is_file():
            raise _missing(name, [f], how, "medmnist left no pathmnist.npz")
        t = _cached(name, root, [f], decode, fix, keys)
    t = dict(t)
    if use_val:
        t["x_train"] = torch.cat([t["x_train"], t["x_val"]])
        t["y_train"] = torch.cat([t["y_train"], t["y_val"]])
    mean, std = (0.7405, 0.5330, 0.7058), (0.1237, 0.1768, 0.0979)
    return _make(name, t, 9, (3, 28, 28), mean, std)


# -------------------------------------------------------------------------- synthetic


@DATASETS.register("synthetic")
def load_synthetic(
    root: Path,
    download: bool,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    num_samples: int = 20000,
    test_frac: float = 0.2,
    seed: int = 0,
    groups: int = 30,
) -> Dataset:
    """Synthetic(alpha, beta) of the FedProx paper (Li et al. 2020), pooled over ``groups``.

    Group k has its own softmax model W_k, b_k ~ N(u_k, 1), u_k ~ N(0, alpha) and its own
    feature mean v_k ~ N(B_k, 1), B_k ~ N(0, beta); x ~ N(v_k, Sigma), Sigma_jj = j^-1.2.
    alpha/beta are standard deviations, as in the FedProx generator code. Groups get
    num_samples // groups samples each, the first num_samples % groups one more.
    """
    if alpha < 0 or beta < 0:
        raise ConfigError(f"synthetic: alpha and beta must be >= 0, got {alpha}, {beta}")
    if dim < 1 or num_classes < 2 or groups < 1 or num_samples < groups:
        raise ConfigError(
            f"synthetic: need dim >= 1, num_classes >= 2, 1 <= groups <= num_samples; got "
            f"dim={dim}, num_classes={num_classes}, groups={groups}, num_samples={num_samples}"
        )
    if not 0.0 < test_frac < 1.0:
        raise ConfigError(f"synthetic: test_frac must be in (0, 1), got {test_frac}")
    rng = np.random.default_rng(seed)
    u = rng.normal(0.0, alpha, groups)
    big_b = rng.normal(0.0, beta, groups)
    sigma_sd = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of the diagonal
    sizes = [num_samples // groups + (k < num_samples % groups) for k in range(groups)]
    xs, ys = [], []
    for k in range(groups):
        w = rng.normal(u[k], 1.0, (dim, num_classes))
        b = rng.normal(u[k], 1.0, num_classes)
        v = rng.normal(big_b[k], 1.0, dim)
        x = v + rng.standard_normal((sizes[k], dim)) * sigma_sd
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))  # argmax of softmax == argmax of logits
    x_all = torch.from_numpy(np.concatenate(xs).astype(np.float32))
    y_all = torch.from_numpy(np.concatenate(ys).astype(np.int64))
    perm = torch.from_numpy(rng.permutation(num_samples))
    n_test = max(1, min(num_samples - 1, round(num_samples * test_frac)))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(
        "synthetic", x_all[train], y_all[train], x_all[test], y_all[test], num_classes, (), ()
    )
