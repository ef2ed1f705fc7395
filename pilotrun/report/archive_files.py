"""What an archive may copy from a run folder: exactly the files a manifest lists, plain files only, inside the run.

The archive is read on another machine, often by someone else: a planted link would put an outside file's
content into it (``tarfile`` and ``shutil.copy2`` follow links), and an unlisted file (a pickle left next to
the weights) would travel as if it were part of the model. So the model is packed file by file from its
manifest, each checked (plain file, size and sha256) through the loading policy's own check, and every other
file the archive takes from the run folder must be a plain file inside it. The two files from outside the run
folder are the ones the ledger recorded: the spec file the run row names, and the factory module the run's lock
recorded (its path inside the spec's folder and its sha256). What is not packed is named, with why.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.io import MANIFEST, CheckpointError, unlisted_files
from ..checkpoint.pinned import pinned


class UnsafeFile(Exception):
    """A file the archive will not copy: the message names it and why."""


def inside(path: Path, root: Path) -> bool:
    """``path`` (links resolved) lies inside ``root`` (links resolved)."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root)))
    except OSError:
        return False


def copy_plain(src: Path, dest: Path, root: Path) -> None:
    """Copy one run file that must be a plain file (never a link, device or FIFO) inside ``root``."""
    try:
        st = src.lstat()
    except FileNotFoundError:
        raise UnsafeFile(f"{src} is missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(f"{src} is a symbolic link (to {os.readlink(src)}): the archive copies plain files only")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{src} is not a regular file: the archive copies plain files only")
    if not inside(src, root):
        raise UnsafeFile(f"{src} lies outside the run folder {root}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest, follow_symlinks=False)


def pack_manifest_files(model_dir: Path, dest: Path, run_folder: Path, recorded_sha: str | None) -> dict:
    """Copy exactly the files ``model_dir``'s manifest lists (and the manifest) into ``dest``.

    Refused (``CheckpointError``): a listed file that is missing, a link, not a plain file, or differs in size or
    sha256; a folder outside the run; a manifest other than the one the ledger recorded (``recorded_sha``).
    Returns ``{"packed": [...], "left_out": [...]}``: unlisted files are left out and named.
    """
    if model_dir.is_symlink() or not inside(model_dir, run_folder):
        raise CheckpointError(f"{model_dir} is a link or lies outside the run folder {run_folder}")
    # Copied from a pinned view: each file packed is the one whose digest was checked, the manifest the very bytes
    # whose sha256 the ledger recorded (a file swapped in between is refused, never packed).
    with pinned(model_dir, recorded_sha, "the ledger recorded for this export (the export was rewritten after the "
                "run)") as view:
        manifest = view.manifest
        packed = []
        for name in sorted(manifest["files"]):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(view.folder / name, dest / name)
            packed.append(name)
        shutil.copyfile(view.folder / MANIFEST, dest / MANIFEST)
    left_out = [str(p.relative_to(model_dir)) for p in unlisted_files(model_dir, manifest)]
    return {"packed": packed, "left_out": left_out}


@dataclass(frozen=True)
class LeftOut:
    """A file the archive did not pack, and why: named in the archive's README and the command's output."""

    path: str
    why: str

    def text(self) -> str:
        return f"{self.path} ({self.why})"


def copy_or_name(src: Path, dest: Path, root: Path, left_out: list[LeftOut]) -> bool:
    """:func:`copy_plain`, or ``src`` named in ``left_out`` with why (a link, not a plain file, outside ``root``)."""
    try:
        copy_plain(src, dest, root)
        return True
    except UnsafeFile as exc:
        left_out.append(LeftOut(str(src), str(exc)))
        return False


def _section(lock: dict, name: str) -> dict:
    value = lock.get(name)
    return value if isinstance(value, dict) else {}


def locked_factory(lock: dict) -> str | None:
    """The model factory the run's lock recorded (None: the spec builds its model without one)."""
    model = _section(lock, "model")
    factory = model.get("factory") if model.get("source") == "factory" else None
    return factory if isinstance(factory, str) else None


def copy_factory_code(lock: dict, spec_path: str | None, dest: Path, left_out: list[LeftOut]) -> bool:
    """Copy the factory module the lock recorded — that one file, from the spec's folder, with its recorded sha256 —
    to ``dest`` at the same relative path; anything else (a file outside the spec's folder, a link, one changed
    since the run) is left out and named. Nothing an export names is copied."""
    model = _section(lock, "model")
    rel, sha = model.get("file"), model.get("source_sha256")
    if not isinstance(rel, str) or not isinstance(sha, str) or not spec_path:
        left_out.append(LeftOut("code/", "the run's lock recorded no file for its factory"))
        return False
    folder = Path(spec_path).resolve().parent
    src = folder / rel
    if Path(rel).is_absolute() or ".." in Path(rel).parts or not inside(src, folder):
        left_out.append(LeftOut(str(src), f"the factory's module lies outside the spec's folder {folder}"))
        return False
    if not copy_or_name(src, dest / rel, folder, left_out):
        return False
    if hashlib.sha256((dest / rel).read_bytes()).hexdigest() != sha:
        (dest / rel).unlink()
        left_out.append(LeftOut(str(src), f"changed since the run's lock recorded it (sha256 {sha[:12]}…)"))
        return False
    return True
