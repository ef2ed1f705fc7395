"""Verify once, use those bytes: the files a loader reads are the very ones whose digests were checked.

:meth:`~pilotrun.checkpoint.trust.LoadPolicy.admit` hashes a folder's files, but a loader that then opens them by
name reads whatever is at that name *now*: a shard, an ``export.json`` or DCP's pickled ``.metadata`` swapped in
between would be used unchecked (the threat: anything that can write the run's output folder while pilotrun reads
it — a shared or mounted folder, another job). :func:`pinned` closes that window. It reads the manifest once (its
sha256 must be the admitted one), then opens each listed file once, with ``O_NOFOLLOW``, checks it is a regular file
of the listed size and hashes it through that open file; the loaders are handed a private view folder
(``mkdtemp``: mode 0700, under the sticky temp folder, so no one else can rename or add entries in it) in which each
name resolves to that same open file (``/proc/PID/fd/N``). A rename, an unlink or a new file at the old name no
longer changes what is read: the view holds the inode that was checked. Only a write *into* that inode could, and
that needs write permission on the file itself: where anyone but this user may write it (another owner, or group
or other write bits), or where ``/proc`` is absent (macOS), the bytes read while hashing are copied into the private
view instead, so what is used is still exactly what was hashed. JSON documents (kilobytes, read by
:mod:`pilotrun.safefile`, which never follows a link) are always copied. Files not in the manifest are not in the
view at all: a planted shard is invisible to a loader that globs.

The cost is one more read of the files (the admission's report reads them once to name every damaged file), hashed
one file per core: ``bench/restore_overhead.py`` measures it against a plain ``torch.load``.
"""
from __future__ import annotations

import os
import resource
import shutil
import stat
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .digest import READ_CHUNK, entry_digest, hasher
from .io import MANIFEST, CheckpointError, entry_name_problem, load_manifest
from .trust import DCP_METADATA, Admission, LoadRefused, Refusal, admitted, sha256_hex
from .writer import writer_threads

# Views alive in this process, by resolved path: what require_known() accepts before DCP unpickles.
_PINNED: dict[str, Admission] = {}
PROC = Path("/proc")


def _open_listed(path: Path) -> BinaryIO:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    return os.fdopen(fd, "rb", buffering=0)


def _shared(st: os.stat_result) -> bool:
    """Whether someone other than this user may write the file in place (the one change an open file sees)."""
    return st.st_uid != os.geteuid() or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _pin_one(src: Path, dest: Path, info: dict) -> tuple[BinaryIO | None, str | None]:
    """Open ``src`` once, check and hash it through that file; link ``dest`` to it, or copy the hashed bytes there.
    Returns (the file kept open for the view, or None once copied; the problem, or None)."""
    try:
        fh = _open_listed(src)
    except FileNotFoundError:
        return None, f"{src} is listed in the manifest but missing"
    except OSError as exc:
        if src.is_symlink():  # ELOOP from O_NOFOLLOW: a link where the file was
            return None, f"{src} is a symbolic link (to {os.readlink(src)}), not the file that was saved"
        return None, f"{src} cannot be opened as the plain file that was saved ({exc.strerror})"
    keep = False
    try:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, f"{src} is not a regular file, not the file that was saved"
        if st.st_size != info["bytes"]:
            return None, f"{src} is {st.st_size} bytes, the manifest says {info['bytes']}: replaced after the check"
        copy = _shared(st) or src.suffix == ".json" or not (PROC / str(os.getpid()) / "fd").is_dir()
        algo, want = entry_digest(info)  # type: ignore[misc]  # load_manifest checked every entry
        h = hasher(algo)
        dest.parent.mkdir(parents=True, exist_ok=True)
        out = open(dest, "xb") if copy else None
        try:
            for chunk in iter(lambda: fh.read(READ_CHUNK), b""):
                h.update(chunk)
                if out is not None:
                    out.write(chunk)
        finally:
            if out is not None:
                out.close()
        if h.hexdigest() != want:
            return None, f"{src} does not match its {algo.value} in the manifest: changed after it was checked"
        if not copy:
            os.symlink(f"/proc/{os.getpid()}/fd/{fh.fileno()}", dest)
            keep = True
        return (fh if keep else None), None
    finally:
        if not keep:
            fh.close()


def _room_for(n: int) -> None:
    """Raise the open-file limit to hold ``n`` more files (a 64 MB-sharded checkpoint of a large model has
    thousands)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise CheckpointError(f"reading this checkpoint holds {n} files open, and this process may open {hard} "
                                  f"at most: raise the limit (ulimit -n {need}) and run again")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@contextmanager
def pinned(folder: Path, expect_sha256: str | None = None,
           expected_as: str = "checked before") -> Iterator[Admission]:
    """``with pinned(folder) as view: load(view.folder / name)``: the admission of a private view whose every file is
    the one whose digest was checked here (see the module). The manifest must hash to ``expect_sha256`` (what
    ``expected_as`` says it is), or to the digest ``folder`` was admitted with in this process; :class:`LoadRefused`
    (``DAMAGED``) names every file that differs. A :class:`CheckpointError` raised inside names ``folder``, not the
    view."""
    folder = Path(folder)
    earlier = admitted(folder)
    want = expect_sha256 or (earlier.manifest_sha256 if earlier is not None else None)
    try:
        manifest, raw = load_manifest(folder)
    except CheckpointError as exc:
        raise LoadRefused(Refusal.DAMAGED, f"{folder} is damaged: {exc}", [str(exc)]) from None
    digest = sha256_hex(raw)
    if want is not None and digest != want:
        msg = f"{folder / MANIFEST} is not the manifest {expected_as} (sha256 {digest[:12]}…, not {want[:12]}…)"
        raise LoadRefused(Refusal.DAMAGED, f"{msg}: not loaded", [msg])
    _room_for(len(manifest["files"]))
    root = Path(tempfile.mkdtemp(prefix="pilotrun-verified-"))
    view = root / folder.name
    kept: list[BinaryIO] = []
    try:
        view.mkdir()
        (view / MANIFEST).write_bytes(raw)
        problems, listed = [], []
        for name, info in sorted(manifest["files"].items()):
            bad = entry_name_problem(name) or (f"the manifest lists {MANIFEST} itself" if name == MANIFEST else None)
            if bad is not None:
                problems.append(bad)
            else:
                listed.append((name, info))
        # Files hashed side by side (BLAKE3 and the reads release the GIL), one thread per core as the save writes.
        with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
            pinned_files = list(pool.map(lambda item: _pin_one(folder / item[0], view / item[0], item[1]), listed))
        for fh, problem in pinned_files:
            if fh is not None:
                kept.append(fh)
            if problem is not None:
                problems.append(problem)
        if problems:
            raise LoadRefused(Refusal.DAMAGED, f"{folder} is damaged: " + "; ".join(problems), problems)
        adm = Admission(view, manifest, digest, earlier.known if earlier is not None else False)
        _PINNED[str(view.resolve())] = adm
        try:
            yield adm
        except CheckpointError as exc:
            if str(view) in str(exc):
                exc.args = (str(exc).replace(str(view), str(folder)), *exc.args[1:])
            raise
        finally:
            _PINNED.pop(str(view.resolve()), None)
    finally:
        for fh in kept:
            fh.close()
        shutil.rmtree(root, ignore_errors=True)


def require_known(folder: Path) -> Admission:
    """Right before anything is unpickled from ``folder`` (DCP's ``.metadata``, and the objects inside its shards):
    it is a pinned view of a folder admitted as known in this process, so the bytes torch unpickles are the ones
    whose digests were checked, and the ledger recorded their manifest."""
    adm = _PINNED.get(str(Path(folder).resolve()))
    if adm is None or not adm.known:
        raise LoadRefused(Refusal.PICKLE, (
            f"{Path(folder) / DCP_METADATA} is a pickle and {folder} is not a checked view of a folder admitted as "
            "known (its manifest recorded in the ledger): pilotrun does not unpickle it"))
    return adm
