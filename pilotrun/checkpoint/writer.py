"""How an atomic folder's files reach the disk: hashed on their way there, written in parallel, flushed behind.

Three parts, each there for a measured cost (``bench/save_overhead.py``):

- :class:`HashingWriter` is the file object a library writes through (``torch.save(obj, writer)``): each buffer is
  hashed and then written, so no byte is read back to hash it. torch hands its tensors' storages to ``write`` as
  memoryviews, without a copy.
- :class:`Writers` runs whole files (a shard each) on a few threads: torch's record writer, the digest and the
  ``write(2)`` copy all release the GIL, so shards go out in parallel, one per core.
- :class:`Flusher` fsyncs and closes finished files on its own thread, so the next file's writes overlap the
  previous one's flush, and each file is fsynced exactly once.

Every byte of every file goes through :meth:`HashingWriter.write`; a failure there (``ENOSPC``) is raised where the
folder waits for its files, and the folder is then removed.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from ..devices import query_host
from .digest import Digest, entry, hasher

# Writer threads: one per core (each keeps one core busy with torch's record writer, the digest and the copy into
# the page cache), at most 8: past that the disk, not the CPU, sets the pace.
MAX_WRITERS = 8


class HashingWriter:
    """A binary file that hashes what is written to it (one pass over the bytes, on their way to the file)."""

    def __init__(self, path: Path, algo: Digest = Digest.SHA256) -> None:
        self.path = Path(path)
        self.algo = algo
        self.fh: BinaryIO = open(path, "wb")
        self.hash = hasher(algo)
        self.bytes = 0

    def write(self, data) -> int:
        mv = memoryview(data)
        self.hash.update(mv)
        self.bytes += mv.nbytes
        return self.fh.write(mv)

    def flush(self) -> None:
        self.fh.flush()

    def tell(self) -> int:
        """Bytes written so far (the file is written front to back: DCP records each item's offset this way)."""
        return self.bytes

    def fileno(self) -> int:
        return self.fh.fileno()

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def entry(self) -> dict:
        """The file's manifest entry: its digest under its algorithm's key, and its size."""
        return entry(self.algo, self.hexdigest(), self.bytes)

    def hand_off(self) -> BinaryIO:
        """The flushed file, for :class:`Flusher` to fsync and close."""
        self.fh.flush()
        return self.fh

    def close(self) -> None:
        """Flush, fsync and close here and now (the manifest: nothing is written after it)."""
        sync_and_close(self.hand_off())


def sync_and_close(fh: BinaryIO) -> None:
    try:
        os.fsync(fh.fileno())
    finally:
        fh.close()


class Flusher:
    """fsync then close each file handed to it, in order, on one background thread; :meth:`wait` raises the first
    failure (an fsync that reports a lost write is a failed save)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pilotrun-fsync")
        self._pending: list[tuple[BinaryIO, Future]] = []

    def submit(self, fh: BinaryIO) -> None:
        self._pending.append((fh, self._pool.submit(sync_and_close, fh)))

    def wait(self) -> None:
        try:
            for _, fut in self._pending:
                fut.result()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop (a failed save): files not yet flushed are closed unflushed; their folder is being removed."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fh, _ in self._pending:
            if not fh.closed:
                fh.close()
        self._pending.clear()


def writer_threads() -> int:
    return max(1, min(MAX_WRITERS, query_host().cpus))


class Writers:
    """Whole files written on a few threads: ``submit(name, job)`` where ``job()`` returns the file's manifest
    entry; :meth:`wait` returns ``{name: entry}`` once all are written, or raises the first failure."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or writer_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}

    def submit(self, name: str, job: Callable[[], dict]) -> None:
        if name in self._pending:
            raise ValueError(f"{name} is already being written into this folder")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="pilotrun-write")
        self._pending[name] = self._pool.submit(job)

    def wait(self) -> dict[str, dict]:
        try:
            return {name: fut.result() for name, fut in self._pending.items()}
        finally:
            self.abandon()

    def abandon(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()


def write_through(path: Path, write: Callable[[Any, Any], Any], obj: Any, flusher: Flusher, algo: Digest) -> dict:
    """``write(obj, file)`` into a new file at ``path``, hashed as it goes; its flush handed to ``flusher``.
    Returns the file's manifest entry."""
    w = HashingWriter(path, algo)
    try:
        write(obj, w)
    except BaseException:
        w.fh.close()
        raise
    flusher.submit(w.hand_off())
    return w.entry()
