"""Atomic folders with a manifest of file digests: a crash mid-save never damages the last good one.

A folder is written as ``.NAME.tmp-PID``: every file is hashed as it is written (:mod:`.writer`; nothing is read
back) and fsynced once, ``manifest.json`` is written last and fsynced, then the folder, and the folder is renamed
into place (then the parent is fsynced). Readers ignore ``.tmp-`` folders and refuse a folder whose files do not
match its manifest. Which digest an entry carries is :mod:`.digest`'s; the manifest's own identity is its sha256.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..safefile import FileKind, FileProblem, read_bytes
from .digest import IDENTITY, Digest, entry, entry_digest, file_digest
from .writer import Flusher, HashingWriter, Writers, sync_and_close, write_through

MANIFEST = "manifest.json"
# A manifest lists a few thousand files at most (kilobytes to a megabyte); /dev/zero behind its name never ends.
MANIFEST_CAP = 64 << 20
# ".step-000008.tmp-4242": the folder AtomicFolder writes before its rename (the PID is the writer's).
TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")
# Errors that mean the filesystem is full (errno(3)): ENOSPC, and EDQUOT for a user's quota.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(Exception):
    """A checkpoint or artifact is missing, incomplete or does not match its manifest."""


def _default_dir_mode() -> int:
    """The mode ``mkdir`` gives a folder in this process (0o777 less the umask), read once at import: ``umask`` can
    only be read by setting it, which would race a thread creating a file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o777 & ~mask


DIR_MODE = _default_dir_mode()


def private_mkdir(path: Path) -> None:
    """A folder only this user may enter while it is written (0o700, whatever the umask or a setgid parent): files a
    library writes there (``save_pretrained``, DCP's shards) are hashed after the library closes them, and in a
    group-writable output folder someone else could otherwise replace one first. :func:`publish_mode` once done."""
    Path(path).mkdir(mode=0o700)
    os.chmod(path, 0o700)


def publish_mode(path: Path) -> None:
    """The mode a plain ``mkdir`` would have given ``path``, once its manifest is written and before it is renamed
    into place (readers that are not this user, a shared team folder, read it as before)."""
    os.chmod(path, DIR_MODE)


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


def hash_and_sync(path: Path, digest: Digest) -> dict:
    """The manifest entry of a file another library wrote (DCP's shards, save_pretrained's), read back once, and an
    fsync."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        size = os.fstat(fh.fileno()).st_size
    return entry(digest, file_digest(path, digest), size)


class AtomicFolder:
    """``with AtomicFolder(final) as f: f.write_json("a.json", {...}); f.submit("b.pt", torch.save, obj)``.

    ``write_with`` writes a file here and now; ``submit`` hands it to the writer threads (several shards at once).
    Either way the file is hashed as it is written and fsynced by a background thread while the next is written;
    leaving the ``with`` waits for all of them, then writes the manifest and renames the folder into place.
    ``digest`` is what the manifest records for each file (:mod:`.digest`: checkpoints pass ``CHECKPOINT_DIGEST``).
    """

    def __init__(self, final: Path, kind: str, meta: dict | None = None, digest: Digest = Digest.SHA256,
                 threads: int | None = None) -> None:
        self.final = Path(final)
        self.kind = kind
        self.digest = digest
        self.meta = meta or {}
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{os.getpid()}"
        self.files: dict[str, dict] = {}
        self._flusher = Flusher()
        self._writers = Writers(threads)
        self.manifest_sha256: str | None = None

    def __enter__(self) -> AtomicFolder:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        private_mkdir(self.tmp)
        return self

    def write_with(self, name: str, writer: Callable[[Any, Any], Any], obj: Any) -> None:
        """``writer(obj, file)`` into ``name``, in this thread."""
        self.files[name] = write_through(self.tmp / name, writer, obj, self._flusher, self.digest)

    def submit(self, name: str, writer: Callable[[Any, Any], Any], obj: Any) -> None:
        """``writer(obj, file)`` into ``name`` on a writer thread; ``obj`` must not change until the folder is
        complete (a live state_dict is fine while the caller waits; a background save writes its own snapshot)."""
        path = self.tmp / name
        self._writers.submit(name, lambda: write_through(path, writer, obj, self._flusher, self.digest))

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write_with(name, lambda d, fh: fh.write(d), data)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=1, sort_keys=True).encode())

    def adopt_existing(self) -> None:
        """Hash files that a library wrote into ``tmp`` itself (e.g. save_pretrained): read back, once."""
        for p in sorted(self.tmp.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(self.tmp))
                if rel in self.files or rel == MANIFEST:
                    continue
                self.files[rel] = hash_and_sync(p, self.digest)

    def _abandon(self) -> None:
        self._writers.abandon()
        self._flusher.abandon()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abandon()
            return
        try:
            self.files.update(self._writers.wait())
            self._flusher.wait()  # every file's data is on disk before the manifest that vouches for it
        except BaseException:
            self._abandon()
            raise
        manifest = {
            "format": f"pilotrun-{self.kind}/1",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "files": self.files,
            **self.meta,
        }
        w = HashingWriter(self.tmp / MANIFEST, IDENTITY)
        try:
            w.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
            sync_and_close(w.hand_off())
        except BaseException:
            w.fh.close()
            self._abandon()
            raise
        self.manifest_sha256 = w.hexdigest()  # of the bytes written, not re-read: what the ledger records
        publish_mode(self.tmp)
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
    """The manifest as a mapping whose ``files`` entries each carry ``bytes`` and one digest (:mod:`.digest`);
    anything else is named as damage (a missing, garbage or hand-edited manifest)."""
    return load_manifest(folder)[0]


def load_manifest(folder: Path) -> tuple[dict, bytes]:
    """The manifest (as :func:`read_manifest`) and the very bytes it was parsed from, read once: their sha256 is the
    folder's identity, so a manifest swapped between a hash and a parse is never one and the other."""
    path = Path(folder) / MANIFEST
    try:
        raw = read_bytes(path, MANIFEST_CAP)
    except FileProblem as exc:
        what = ("is missing" if exc.kind is FileKind.MISSING else
                "is not a plain file" if exc.kind is FileKind.NOT_REGULAR else exc.what)
        raise CheckpointError(f"{path} {what}: not a complete pilotrun checkpoint (an interrupted save, or "
                              "damaged)") from None
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); the checkpoint is damaged") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(entry_digest(v) is not None for v in files.values()):
        raise CheckpointError(f"{path}: field 'files' is not a mapping of file -> {{bytes, and one of sha256 or "
                              "blake3}; the manifest is damaged or was not written by pilotrun")
    return manifest, raw


# A listed name pilotrun writes is a few dozen characters ("dcp/__0_0.distcp"); beyond these lstat() raises.
ENTRY_NAME_MAX, ENTRY_PART_MAX_BYTES = 1024, 255


def entry_name_problem(name: str) -> str | None:
    """Why a manifest's file name cannot be a file pilotrun wrote in the folder (None: it can): outside the folder,
    a NUL byte, too long, not encodable as a file name (lstat would raise ValueError, OSError or UnicodeError)."""
    shown = repr(name) if len(name) <= 60 else f"{name[:60]!r}… ({len(name)} characters)"
    if "\0" in name:
        return f"the manifest lists {shown}, a name with a NUL byte"
    try:
        parts = os.fsencode(name).split(b"/")
    except UnicodeError:
        return f"the manifest lists {shown}, not encodable as a file name"
    if len(name) > ENTRY_NAME_MAX or any(len(part) > ENTRY_PART_MAX_BYTES for part in parts):
        return f"the manifest lists {shown}, a name longer than a file name may be"
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"the manifest lists {name!r}, a path outside the folder"
    return None


def _problem(folder: Path, name: str, info: dict) -> str | None:
    """What is wrong with one listed file, or None. Never reads a link or a device: /dev/zero would never end."""
    p = folder / name
    if (bad_name := entry_name_problem(name)) is not None:
        return bad_name
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
    algo, want = entry_digest(info)  # type: ignore[misc]  # read_manifest checked every entry
    digest = file_digest(p, algo)
    if digest != want:
        return (f"{p} does not match its {algo.value} in the manifest ({digest[:12]}…, the manifest says "
                f"{want[:12]}…): corrupted or replaced (same size)")
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


def folder_problems(folder: Path, manifest: dict | None = None) -> list[str]:
    """Every way ``folder`` differs from its manifest (``manifest``: the one already read), file by file (empty:
    intact).

    Files present but not listed count too: a renamed shard or a planted file is not what was saved, and
    loaders that look for a name pattern would pick it up.
    """
    folder = Path(folder)
    if manifest is None:
        try:
            manifest = read_manifest(folder)
        except CheckpointError as exc:
            return [str(exc)]
    return listed_problems(folder, manifest) + [
        f"{p} is not in the manifest (renamed, planted or left over): not what was saved"
        for p in unlisted_files(folder, manifest)]


def verify_folder(folder: Path) -> dict:
    """Check every file against the manifest; return the manifest or raise naming every bad file."""
    manifest = read_manifest(folder)
    problems = folder_problems(folder, manifest)
    if problems:
        raise CheckpointError("; ".join(problems))
    return manifest


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

