"""Per-client rows kept off the device: personal models, control variates, kept optimizer state.

A federation of 10,000 clients with one [N, D] store of an FMNIST MLP (D = 199,210) needs 8 GB
for that store alone, and a round uses the rows of its few sampled clients. `ClientRows` holds
the rows in host memory (a store above `RowsPolicy.in_memory_bytes`: a memory-mapped file in
the run directory, `engine.host_rows_gib`) and moves only the rows a round asks for to the
device: `rows[idx]` is a device tensor [C, ...] (`rows[i]`: [...]), `rows[idx] = values`
writes them back. Rows never written read as the store's `default` row (every client's
initial value), so a store costs memory (and disk) only for the clients that trained.

Checkpoints are incremental: the rows are cut into shards of `shard_rows` consecutive clients
(about `SHARD_BYTES` each), and a checkpoint rewrites the shards holding a row written since
the previous one (`dirty`); `fedbench.checkpoint` names, writes and verifies the shard files.
`touched` marks every row read or written (tests: a round touches its sampled clients only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHARD_BYTES = 1 << 20  # about 1 MiB per checkpoint shard (one row at least)
ROWS_KEY = "client_rows"  # marks a store's manifest in a checkpoint's state
GIB = 1 << 30


@dataclass(frozen=True)
class RowsPolicy:
    """Where the rows of one store live: host memory up to `in_memory_bytes`, else a
    memory-mapped file in `directory` (None: host memory whatever the size)."""

    in_memory_bytes: int = 2 * GIB
    directory: Path | None = None


@dataclass(frozen=True)
class SavedRows:
    """A store as a checkpoint holds it: its manifest and `read(file, sha256) -> bytes`,
    which returns a shard's verified bytes (`fedbench.checkpoint`)."""

    manifest: dict
    read: Callable[[str, str], bytes]


def _ids(idx: Any, n: int) -> tuple[torch.Tensor, bool]:
    """(client indices as a CPU long tensor [C], whether `idx` was one int)."""
    if isinstance(idx, int | np.integer):
        return torch.tensor([int(idx)]), True
    if isinstance(idx, slice):
        return torch.arange(n)[idx], False
    if isinstance(idx, torch.Tensor):
        if idx.dtype == torch.bool:
            raise TypeError("ClientRows: index with client ids, not a boolean mask")
        # ids on meta (shapes only) stay there: a meta store indexes its meta rows with them
        host = "meta" if idx.is_meta else "cpu"
        if idx.dim() == 0:
            return idx.detach().reshape(1).to(host, torch.long), True
        return idx.detach().reshape(-1).to(host, torch.long), False
    return torch.as_tensor(np.asarray(idx, dtype=np.int64)).reshape(-1), False


def _split(idx: Any) -> tuple[Any, tuple]:
    """(the clients, the index into each row): `rows[clients, cols]` as a tensor reads."""
    return (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())


class ClientRows:
    """[N, *row_shape] rows, one per client, on the host; reads and writes move rows between
    the host and `device` (module docstring)."""

    def __init__(
        self,
        n: int,
        default: torch.Tensor,
        *,
        device: torch.device | str,
        name: str,
        policy: RowsPolicy | None = None,
        shard_rows: int | None = None,
    ) -> None:
        self.n = n
        self.name = name
        self.device = torch.device(device)
        self.policy = policy or RowsPolicy()
        # where the rows live: the host, except for `meta` (shapes without data, the tests'
        # stand-in for a GPU), whose rows cannot be copied out and stay there
        self.host = torch.device("meta" if self.device.type == "meta" else "cpu")
        self.default = default.detach().to(self.host).clone()
        self.row_shape = tuple(self.default.shape)
        self.dtype = self.default.dtype
        row_bytes = max(1, self.default.numel() * self.default.element_size())
        self.shard_rows = shard_rows or max(1, SHARD_BYTES // row_bytes)
        self.written = torch.zeros(n, dtype=torch.bool)  # holds its own value (else default)
        self.dirty = torch.zeros(n, dtype=torch.bool)  # written since the last checkpoint
        self.touched = torch.zeros(n, dtype=torch.bool)  # read or written (reset freely)
        self.mapped = False  # the rows live in a memory-mapped file
        self._data: torch.Tensor | None = None  # [N, ...] on the host, allocated at a write
        self._saved: dict[int, tuple[str, str]] = {}  # shard -> (file, sha256) last saved

    # ------------------------------------------------------------------ as a tensor
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, *self.row_shape))

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.n * self.default.numel() * self.default.element_size()

    @property
    def _meta(self) -> bool:
        """Rows on `meta`: no values, so no bookkeeping of which rows were written (that is
        data too); every read and write keeps its shapes, as the tests' stand-in for a GPU."""
        return self.host.type == "meta"

    def _host_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._meta:
            if self._data is None:
                return self.default.expand(len(ids), *self.row_shape).clone()
            return self._data[ids]
        out = self.default.expand(len(ids), *self.row_shape).clone()
        if self._data is not None:
            own = self.written[ids]
            if bool(own.all()):
                return self._data[ids]
            if bool(own.any()):
                out[own] = self._data[ids[own]]
        return out

    def __getitem__(self, idx: Any) -> torch.Tensor:
        idx, cols = _split(idx)
        ids, one = _ids(idx, self.n)
        if not self._meta:
            self.touched[ids] = True
        out = self._host_rows(ids).to(self.device)
        return out[0][cols] if one else out[(slice(None), *cols)]

    def __setitem__(self, idx: Any, value: torch.Tensor | float) -> None:
        idx, cols = _split(idx)
        if cols:  # part of each row: read the rows, change that part, write them back
            rows = self[idx]
            rows[cols if isinstance(idx, int | np.integer) else (slice(None), *cols)] = value
            value = rows
        ids, _ = _ids(idx, self.n)
        v = torch.as_tensor(value).detach().to(self.host, self.dtype)
        self._allocate()
        assert self._data is not None
        self._data[ids] = v.expand(len(ids), *self.row_shape)
        if self._meta:
            return
        self.written[ids] = True
        self.dirty[ids] = True
        self.touched[ids] = True

    def all(self) -> torch.Tensor:
        """Every row on the device [N, ...]: for the few algorithms that combine all
        clients' rows at once (N rows of device memory)."""
        return self[torch.arange(self.n)]

    def clone(self) -> torch.Tensor:
        """A copy of every row (`all`), as `tensor.clone()`."""
        return self.all()

    def copy_(self, src: torch.Tensor) -> ClientRows:
        """Every row set to `src` ([N, ...] or one row, broadcast), as `tensor.copy_`."""
        self[torch.arange(self.n)] = src
        return self

    def __getattr__(self, name: str) -> Any:
        """Tensor methods that read (`rows.abs()`, `rows.sum(0)`) act on every row (`all`);
        in-place ones (a trailing `_`) would change a copy, so they are refused."""
        if name.startswith("_") or name.endswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.all(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function given a store sees every row (`all`): `torch.equal(rows, t)`,
        `t - rows` read as on the [N, ...] tensor the store replaces."""
        from torch.utils._pytree import tree_map

        whole = lambda x: x.all() if isinstance(x, ClientRows) else x  # noqa: E731
        return func(*tree_map(whole, tuple(args)), **tree_map(whole, kwargs or {}))

    def _allocate(self) -> None:
        """The host rows, at the first write: memory, or a memory-mapped file past the
        policy's size (created in the run directory and unlinked at once: the mapping keeps
        it while the run lives, and a killed run leaves no file behind)."""
        if self._data is not None:
            return
        d = self.policy.directory
        if d is None or self.nbytes <= self.policy.in_memory_bytes or self.host.type == "meta":
            self._data = torch.empty(self.shape, dtype=self.dtype, device=self.host)
            return
        d.mkdir(parents=True, exist_ok=True)
        path = d / f".{self.name}.{id(self):x}.rows"
        np_dtype = torch.empty(0, dtype=self.dtype).numpy().dtype
        arr = np.memmap(path, dtype=np_dtype, mode="w+", shape=tuple(self.shape))
        path.unlink()
        self._data = torch.from_numpy(arr)
        self.mapped = True

    # ------------------------------------------------------------------ checkpoints
    def _shard_range(self, s: int) -> tuple[int, int]:
        return s * self.shard_rows, min(self.n, (s + 1) * self.shard_rows)

    def save(self, write: Callable[[str, bytes], tuple[str, str]]) -> tuple[dict, int]:
        """Write the shards holding a row written since the last save (`write(stem, bytes)`
        stores one and returns its file name and SHA-256) and return (the store's manifest for the
        checkpoint, the bytes written). Shards of clients never written are absent."""
        written = 0
        for s in torch.unique(self.dirty.nonzero().flatten() // self.shard_rows).tolist():
            lo, hi = self._shard_range(s)
            block = self._host_rows(torch.arange(lo, hi)).contiguous()
            data = block.numpy().tobytes()
            self._saved[s] = write(f"{self.name}.{s}", data)
            written += len(data)
        self.dirty.zero_()
        manifest = {
            ROWS_KEY: 1,
            "name": self.name,
            "n": self.n,
            "row_shape": list(self.row_shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "shard_rows": self.shard_rows,
            "default": self.default.clone(),
            "written": self.written.clone(),
            "shards": {s: list(v) for s, v in sorted(self._saved.items())},
        }
        return manifest, written

    def files(self) -> set[str]:
        """The shard files the last save's manifest names."""
        return {f for f, _ in self._saved.values()}

    def load(self, saved: SavedRows | ClientRows | torch.Tensor) -> None:
        """The rows of a checkpoint: a manifest whose shards are read (verified) through
        `saved.read`, a whole [N, ...] tensor (a checkpoint of a fedbench before shards), or
        another store (a copy, e.g. a state pickled whole)."""
        self._data, self.mapped = None, False
        self.dirty.zero_()
        self.touched.zero_()
        self._saved = {}
        if isinstance(saved, ClientRows):
            if saved.shape != self.shape:
                raise ValueError(f"{self.name}: rows {tuple(saved.shape)}, want {self.shape}")
            self.default = saved.default.to(self.host).clone()
            if saved._data is not None:
                self._allocate()
                assert self._data is not None
                self._data.copy_(saved._data)
            if not self._meta:
                self.written = saved.written.to("cpu").clone()
                self.dirty.copy_(self.written)
            return
        if isinstance(saved, torch.Tensor):
            if tuple(saved.shape) != tuple(self.shape):
                raise ValueError(f"{self.name}: rows {tuple(saved.shape)}, want {self.shape}")
            self[torch.arange(self.n)] = saved
            self.dirty.fill_(True)  # the next checkpoint writes them as shards
            self.touched.zero_()
            return
        m = saved.manifest
        want = (self.n, list(self.row_shape), str(self.dtype).removeprefix("torch."))
        got = (int(m["n"]), list(m["row_shape"]), str(m["dtype"]))
        if got != want:
            raise ValueError(f"{self.name}: rows {got}, want {want}")
        self.default = m["default"].to("cpu", self.dtype).clone()
        self.written = m["written"].to("cpu", torch.bool).clone()
        shard_rows = int(m["shard_rows"])
        for s, (fname, digest) in m["shards"].items():
            s = int(s)
            lo, hi = s * shard_rows, min(self.n, (s + 1) * shard_rows)
            data = saved.read(fname, digest)
            block = torch.frombuffer(bytearray(data), dtype=self.dtype)
            self._allocate()
            assert self._data is not None
            self._data[lo:hi] = block.reshape(hi - lo, *self.row_shape)
            if shard_rows == self.shard_rows:
                self._saved[s] = (fname, digest)
        if shard_rows != self.shard_rows:  # another shard size: the next save writes all
            self.dirty.copy_(self.written)
