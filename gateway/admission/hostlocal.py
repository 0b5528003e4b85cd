"""Admission caps shared by the worker processes of one host (`slogate serve --workers N`),
without Redis.

**SlotTable** is the mechanism: a small file, memory-mapped by every worker, holding one row per
key (any string up to 64 bytes: a backend name today, `tenant:<name>` for a per-tenant quota
tomorrow) and in each row one counter per worker. Every operation takes the file's `flock` for
the few microseconds it needs, so a check-and-increment is atomic across processes and a cap
holds exactly on the host — never N× the configured cap:

    table.try_acquire(key, cap) -> bool   # one slot if the row's total is below cap
    table.release(key)                    # give back one of *this worker's* slots
    table.force_acquire(key)              # one slot regardless of the cap (a moved request)
    table.in_use(key) -> int              # the row's total
    table.clear_worker(index)             # the supervisor, when a worker died: its slots free

A worker that dies frees its slots when the supervisor clears its column (before it starts the
replacement), so a SIGKILLed worker never leaks capacity. Any admission rule that needs "at most
C at once, host-wide" (per-tenant concurrency quotas, say) can use its own keys in the same
table: `try_acquire(f"tenant:{name}", quota)` on admit, `release(...)` in finish. In
server.build_app the table is `worker.slot_table()` when `worker` (a workers.WorkerContext) is
not None; a single gateway has no table and counts in memory as before. Key prefixes in use:
`backend:` (HostLocalState) and `redis-fallback:` (shared.SharedState while Redis is down).
The table holds at most MAX_KEYS keys of KEY_BYTES each: keys must be a bounded set (configured
tenants, backends), never a client-chosen string.

**HostLocalState** puts the table behind the interface the admission controller already speaks
to Redis through (`shared.SharedState`: try_acquire / release / move / remote_prefill_tokens /
snapshot), so the controller does not know which one it has. With Redis configured, workers use
Redis (each worker is one gateway there, with its own lease) and this table only bounds the
host's share while Redis is unreachable.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway.admission.controller import AdmissionController

MAGIC = b"SLOGSLT1"
KEY_BYTES = 64
MAX_KEYS = 1024
_HEADER = struct.Struct("<8sII")  # magic, workers, keys used


class SlotTable:
    """Per-key, per-worker slot counters in a shared file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], workers: int, index: int = -1) -> None:
        """Open (creating if needed) the table at `path` for `workers` workers; `index` is this
        process's worker (-1: the supervisor, which only reads and clears)."""
        self.path = str(path)
        self.workers = workers
        self.index = index
        self._row = KEY_BYTES + 8 * workers
        size = _HEADER.size + MAX_KEYS * self._row
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._flock(fd):
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
                magic, n, _used = _HEADER.unpack_from(mm, 0)
                if magic != MAGIC:
                    _HEADER.pack_into(mm, 0, MAGIC, workers, 0)
                elif n != workers:
                    raise ValueError(f"slot table {self.path} is for {n} workers, not {workers}")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._mm = mm
        self._slots: dict[str, int] = {}  # key -> row offset (rows never move)

    def close(self) -> None:
        self._mm.close()
        os.close(self._fd)

    @staticmethod
    @contextlib.contextmanager
    def _flock(fd: int) -> Iterator[None]:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return self._flock(self._fd)

    def _offset(self, key: str, create: bool) -> int | None:
        """The row of `key` (call with the lock held)."""
        known = self._slots.get(key)
        if known is not None:
            return known
        name = key.encode()
        if len(name) > KEY_BYTES:
            raise ValueError(f"slot key longer than {KEY_BYTES} bytes: {key[:80]!r}")
        padded = name.ljust(KEY_BYTES, b"\0")
        mm = self._mm
        used: int = _HEADER.unpack_from(mm, 0)[2]
        for i in range(used):
            off = _HEADER.size + i * self._row
            if bytes(mm[off:off + KEY_BYTES]) == padded:
                self._slots[key] = off
                return off
        if not create:
            return None
        if used >= MAX_KEYS:
            raise RuntimeError(f"slot table {self.path} is full ({MAX_KEYS} keys)")
        off = int(_HEADER.size + used * self._row)
        mm[off:off + KEY_BYTES] = padded
        mm[off + KEY_BYTES:off + self._row] = bytes(8 * self.workers)
        _HEADER.pack_into(mm, 0, MAGIC, self.workers, used + 1)
        self._slots[key] = off
        return off

    def _counts(self, off: int) -> tuple[int, ...]:
        return struct.unpack_from(f"<{self.workers}q", self._mm, off + KEY_BYTES)

    def _cell(self, off: int, worker: int) -> int:
        return off + KEY_BYTES + 8 * worker

    def try_acquire(self, key: str, cap: int) -> bool:
        """One slot of `key` for this worker if the host-wide total is below `cap`."""
        with self._locked():
            off = self._offset(key, True)
            assert off is not None
            if sum(self._counts(off)) >= cap:
                return False
            cell = self._cell(off, self.index)
            struct.pack_into("<q", self._mm, cell, struct.unpack_from("<q", self._mm, cell)[0] + 1)
            return True

    def force_acquire(self, key: str) -> None:
        """One slot of `key` for this worker, whatever the cap (a request already under way
        moved here)."""
        with self._locked():
            off = self._offset(key, True)
            assert off is not None
            cell = self._cell(off, self.index)
            struct.pack_into("<q", self._mm, cell, struct.unpack_from("<q", self._mm, cell)[0] + 1)

    def release(self, key: str) -> bool:
        """Give back one of this worker's slots of `key` (never another worker's; False if this
        worker holds none)."""
        with self._locked():
            off = self._offset(key, False)
            if off is None:
                return False
            cell = self._cell(off, self.index)
            n = struct.unpack_from("<q", self._mm, cell)[0]
            if n <= 0:
                return False
            struct.pack_into("<q", self._mm, cell, n - 1)
            return True

    def in_use(self, key: str) -> int:
        with self._locked():
            off = self._offset(key, False)
            return 0 if off is None else sum(self._counts(off))

    def clear_worker(self, worker: int) -> dict[str, int]:
        """Free every slot `worker` held (it died); returns what it held."""
        freed: dict[str, int] = {}
        with self._locked():
            for key, counts in self._rows():
                off = self._offset(key, False)
                assert off is not None
                if counts[worker]:
                    freed[key] = counts[worker]
                    struct.pack_into("<q", self._mm, self._cell(off, worker), 0)
        return freed

    def _rows(self) -> list[tuple[str, tuple[int, ...]]]:
        _magic, _n, used = _HEADER.unpack_from(self._mm, 0)
        rows = []
        for i in range(used):
            off = _HEADER.size + i * self._row
            key = bytes(self._mm[off:off + KEY_BYTES]).rstrip(b"\0").decode()
            rows.append((key, self._counts(off)))
        return rows

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """{key: {"total": n, "by_worker": [n0, n1, ...]}}."""
        with self._locked():
            return {key: {"total": sum(c), "by_worker": list(c)} for key, c in self._rows()}


BACKEND_PREFIX = "backend:"


class HostLocalState:
    """The admission controller's shared-state interface (as `shared.SharedState`) on a
    SlotTable: per-replica caps exact across the host's workers."""

    def __init__(self, table: SlotTable, publish_dir: str | None = None,
                 refresh_s: float = 0.5) -> None:
        self.table = table
        self.publish_dir = publish_dir  # the workers' published admission snapshots
        self.refresh_s = refresh_s
        self.local: dict[str, int] = {}  # this worker's slots per replica
        self.limits: dict[str, int] = {}
        self.remote_work: dict[str, dict[str, Any]] = {}
        self.acquires = 0
        self.rejects = 0
        self._ctrl: AdmissionController | None = None
        self._task: asyncio.Task[None] | None = None

    def attach(self, controller: AdmissionController) -> None:
        self._ctrl = controller

    async def start(self) -> None:
        if self.publish_dir is not None:
            self._task = asyncio.create_task(self._loop(), name="slogate-host-work")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for backend, n in list(self.local.items()):
            for _ in range(n):
                self.table.release(BACKEND_PREFIX + backend)
        self.local.clear()

    async def try_acquire(self, backend: str, limit: int) -> bool:
        self.limits[backend] = limit
        if self.table.try_acquire(BACKEND_PREFIX + backend, limit):
            self.local[backend] = self.local.get(backend, 0) + 1
            self.acquires += 1
            return True
        self.rejects += 1
        return False

    def release(self, backend: str) -> None:
        n = self.local.get(backend, 0)
        if n <= 0:
            return
        self.local[backend] = n - 1
        self.table.release(BACKEND_PREFIX + backend)

    def move(self, src: str, dst: str) -> None:
        if src == dst or self.local.get(src, 0) <= 0:
            return
        self.release(src)
        self.local[dst] = self.local.get(dst, 0) + 1
        self.table.force_acquire(BACKEND_PREFIX + dst)

    def remote_prefill_tokens(self, backend: str) -> float:
        """Prompt tokens the host's other workers admitted to `backend` and have not seen a
        first token for (as of their last publish)."""
        return float(sum(w.get("replicas", {}).get(backend, {}).get("prefill_tokens", 0.0)
                         for w in self.remote_work.values()))

    def snapshot(self) -> dict[str, Any]:
        slots = self.table.snapshot()
        return {
            "state": "host", "worker": self.table.index, "workers": self.table.workers,
            "in_flight_here": dict(self.local),
            "in_flight_host": {k[len(BACKEND_PREFIX):]: v for k, v in slots.items()
                               if k.startswith(BACKEND_PREFIX)},
            "other_slots": {k: v for k, v in slots.items() if not k.startswith(BACKEND_PREFIX)},
            "acquired": self.acquires, "refused": self.rejects,
        }

    async def _loop(self) -> None:
        assert self.publish_dir is not None
        while True:
            await asyncio.sleep(self.refresh_s)
            work: dict[str, dict[str, Any]] = {}
            for path in Path(self.publish_dir).glob("w*.json"):
                if path.stem == f"w{self.table.index}":
                    continue
                try:
                    snap = orjson.loads(path.read_bytes())
                except (OSError, orjson.JSONDecodeError):
                    continue
                replicas = (snap.get("admission") or {}).get("replicas", {})
                work[path.stem] = {"replicas": {
                    name: {"prefill_tokens": r.get("prefill_tokens", 0.0)}
                    for name, r in replicas.items() if isinstance(r, dict)}}
            self.remote_work = work
