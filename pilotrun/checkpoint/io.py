"""Atomic folders with a sha256 manifest: a crash mid-save never damages the last good one.

A folder is written as ``.NAME.tmp-PID``, every file is flushed and fsynced with
its sha256 computed while writing, ``manifest.json`` is written last, and the
folder is renamed into place (then the parent is fsynced). Readers ignore
``.tmp-`` folders and refuse a folder whose files do not match its manifest.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
# ".step-000008.tmp-4242": the folder AtomicFolder writes before its rename (the PID is the writer's).
TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")
# Errors that mean the filesystem is full (errno(3)): ENOSPC, and EDQUOT for a user's quota.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
HASH_CHUNK = 8 << 20  # measured: larger reads overlap worse with torch.save on 2 cores


class CheckpointError(Exception):
    """A checkpoint or artifact is missing, incomplete or does not match its manifest."""


class HashingWriter:
    """A binary file that hashes what is written to it (one pass over the bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = open(path, "wb")
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        mv = memoryview(data)
        self.sha.update(mv)
        self.bytes += mv.nbytes
        return self.fh.write(mv)

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def hash_and_sync(path: Path) -> dict:
    """sha256 of a file just written (read back from the page cache) and an fsync; runs in a thread."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(HASH_CHUNK), b""):
            h.update(chunk)  # releases the GIL: overlaps torch.save of the next shard
        size = fh.tell()
        os.fsync(fh.fileno())
    return {"sha256": h.hexdigest(), "bytes": size}


class AtomicFolder:
    """``with AtomicFolder(final) as f: f.write_json("a.json", {...});
    f.write_file("b.pt", lambda p: torch.save(obj, p))``.

    Large files are written by the library's own fast path (``write_file``) and hashed and
    fsynced by a background thread while the next file is being written.
    """

    def __init__(self, final: Path, kind: str, meta: dict | None = None) -> None:
        self.final = Path(final)
        self.kind = kind
        self.meta = meta or {}
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{os.getpid()}"
        self.files: dict[str, dict] = {}
        self._pending: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.manifest_sha256: str | None = None

    def __enter__(self) -> AtomicFolder:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self

    def write_with(self, name: str, writer: Callable[[Any, Any], Any], obj: Any) -> None:
        w = HashingWriter(self.tmp / name)
        try:
            writer(obj, w)
        finally:
            w.close()
        self.files[name] = {"sha256": w.sha.hexdigest(), "bytes": w.bytes}

    def write_file(self, name: str, write: Callable[[Path], Any]) -> None:
        """``write(path)`` creates the file; hashing and fsync overlap with whatever is written next."""
        path = self.tmp / name
        write(path)
        if self._pool is None:
            # One hashing thread per spare core (up to 4): shards hash in parallel on big nodes.
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pilotrun-hash")
        self._pending[name] = self._pool.submit(hash_and_sync, path)

    def _finish_pending(self) -> None:
        for name, fut in self._pending.items():
            self.files[name] = fut.result()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write_with(name, lambda d, fh: fh.write(d), data)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=1, sort_keys=True).encode())

    def adopt_existing(self) -> None:
        """Hash files that a library wrote into ``tmp`` itself (e.g. save_pretrained)."""
        for p in sorted(self.tmp.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(self.tmp))
                if rel in self.files or rel == MANIFEST:
                    continue
                with open(p, "rb+") as fh:
                    h = hashlib.sha256()
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                    os.fsync(fh.fileno())
                self.files[rel] = {"sha256": h.hexdigest(), "bytes": p.stat().st_size}

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        self._finish_pending()
        manifest = {
            "format": f"pilotrun-{self.kind}/1",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "files": self.files,
            **self.meta,
        }
        w = HashingWriter(self.tmp / MANIFEST)
        w.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        w.close()
        self.manifest_sha256 = w.sha.hexdigest()  # of the bytes written, not re-read: what the ledger records
        fsync_dir(self.tmp)
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.rename(self.final, old)
        os.rename(self.tmp, self.final)
        fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    @property
    def total_bytes(self) -> int:
        return sum(f["bytes"] for f in self.files.values())


def read_manifest(folder: Path) -> dict:
    """The manifest as a mapping whose ``files`` entries each carry ``sha256`` and ``bytes``; anything else is
    named as damage (a missing, garbage or hand-edited manifest)."""
    path = Path(folder) / MANIFEST
    if not path.is_file() or path.is_symlink():
        what = "is not a plain file" if path.exists() or path.is_symlink() else "is missing"
        raise CheckpointError(f"{path} {what}: not a complete pilotrun checkpoint (an interrupted save, or damaged)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); the checkpoint is damaged") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in files.values()):
        raise CheckpointError(f"{path}: field 'files' is not a mapping of file -> {{sha256, bytes}}; the manifest is "
                              "damaged or was not written by pilotrun")
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _problem(folder: Path, name: str, info: dict) -> str | None:
    """What is wrong with one listed file, or None. Never reads a link or a device: /dev/zero would never end."""
    p = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"the manifest lists {name!r}, a path outside the folder"
    try:
        st = p.lstat()
    except FileNotFoundError:
        return f"{p} is listed in the manifest ({info['bytes']} bytes) but missing (deleted or renamed)"
    if stat.S_ISLNK(st.st_mode):
        return f"{p} is a symbolic link (to {os.readlink(p)}), not the file that was saved"
    if not stat.S_ISREG(st.st_mode):
        return f"{p} is not a regular file (a device, FIFO or folder), not the file that was saved"
    if st.st_size != info["bytes"]:
        return f"{p} is {st.st_size} bytes, the manifest says {info['bytes']}: truncated or replaced"
    digest = _sha256(p)
    if digest != info["sha256"]:
        return (f"{p} does not match its sha256 in the manifest ({digest[:12]}…, the manifest says "
                f"{info['sha256'][:12]}…): corrupted or replaced (same size)")
    return None


def listed_problems(folder: Path, manifest: dict) -> list[str]:
    """What is wrong with each file the manifest lists (empty: every one is as saved)."""
    return [msg for name, info in sorted(manifest["files"].items()) if (msg := _problem(Path(folder), name, info))]


def unlisted_files(folder: Path, manifest: dict) -> list[Path]:
    """Files (and links) in ``folder`` that the manifest does not list; a linked folder is named, never entered."""
    listed = set(manifest["files"]) | {MANIFEST}
    out = []
    for root, dirs, names in os.walk(folder):  # followlinks=False
        for name in sorted(names + [d for d in dirs if (Path(root) / d).is_symlink()]):
            p = Path(root) / name
            if str(p.relative_to(folder)) not in listed:
                out.append(p)
    return out


def folder_problems(folder: Path) -> list[str]:
    """Every way ``folder`` differs from its manifest, file by file (empty: intact).

    Files present but not listed count too: a renamed shard or a planted file is not what was saved, and
    loaders that look for a name pattern would pick it up.
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return [str(exc)]
    return listed_problems(folder, manifest) + [
        f"{p} is not in the manifest (renamed, planted or left over): not what was saved"
        for p in unlisted_files(folder, manifest)]


def verify_folder(folder: Path) -> dict:
    """Check every file against the manifest; return the manifest or raise naming every bad file."""
    problems = folder_problems(folder)
    if problems:
        raise CheckpointError("; ".join(problems))
    return read_manifest(folder)


def recover_interrupted_swap(root: Path) -> list[str]:
    """Undo a replace that was killed between its two renames: ``.X.old-PID`` back to ``X``."""
    restored = []
    for old in Path(root).glob(".*.old-*"):
        name = old.name[1:].rsplit(".old-", 1)[0]
        final = old.parent / name
        if not final.exists() and (old / MANIFEST).exists():
            os.rename(old, final)
            restored.append(name)
    return restored


def latest_checkpoint(root: Path, verify: bool = True) -> Path | None:
    """The newest complete ``step-*`` folder under ``root``; half-written ``.tmp-`` folders are ignored."""
    root = Path(root)
    if not root.exists():
        return None
    recover_interrupted_swap(root)
    for folder in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        try:
            verify_folder(folder) if verify else read_manifest(folder)
        except CheckpointError:
            continue
        return folder
    return None


def _process_gone(pid: int) -> bool:
    """True only when no process has this PID (a live one, even another user's, keeps its folder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def tree_bytes(path: Path) -> int:
    """Bytes of every file under ``path``, links not followed."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove_stale_temps(root: Path) -> list[tuple[Path, int]]:
    """Remove the ``.NAME.tmp-PID`` folders under ``root`` whose writer is gone (a save killed mid-write);
    ``(folder, bytes freed)`` for each. A folder whose PID is alive may still be being written: it stays."""
    removed: list[tuple[Path, int]] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        m = TEMP_RE.match(p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or not _process_gone(pid):
            continue
        size = tree_bytes(p)
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append((p, size))
    return removed


def disk_full_error(exc: BaseException) -> OSError | None:
    """The OSError saying the filesystem is full, in ``exc`` or the exceptions it chains; None otherwise."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in DISK_FULL:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None

