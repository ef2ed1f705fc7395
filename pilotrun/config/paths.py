"""Where a spec's path values point: relative to the spec file's folder, inside an installed package (``pkg:``),
or nowhere local (a Hugging Face Hub id).

Example::

    resolve_path("data/train.jsonl", spec.folder)   # spec.folder / "data/train.jsonl"
    looks_local("gpt2"), looks_local("./tokenizer")  # False, True
"""
from __future__ import annotations

import fnmatch
import glob
import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# A Hub id is "name" or "org/name"; anything with more path parts, or that starts
# like a path, must exist on disk.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# Data in a bucket (data.path: s3://bucket/prefix/train.jsonl): pilotrun reads files, so a bucket is read where a task
# put it on disk. `plan --skypilot` copies each bucket folder the spec names onto the node (file_mounts) and says
# where in this variable, a JSON object {"s3://bucket/prefix": "/pilotrun-data/0"}; here nothing is mounted.
DATA_MOUNTS_VAR = "PILOTRUN_DATA_MOUNTS"
# scheme://bucket/key: a bucket name of 3-63 lowercase letters, digits, '.', '_' or '-', and a file's key (no empty,
# '.' or '..' part, not a folder's trailing '/').
BUCKET_DATA = re.compile(r"^(s3|gs|r2|cos|oci)://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[A-Za-z0-9._~:@+=%-]+)+$")


def bucket_data_problem(value: str) -> str | None:
    """Why a bucket URI cannot name a data file a task copies, or None."""
    parts = value.split("://", 1)[1].split("/")[1:] if "://" in value else []
    if BUCKET_DATA.match(value) and not any(p in (".", "..") for p in parts):
        return None
    return (f"{value!r} is not a bucket file a task can copy: scheme://bucket/folder/file.jsonl, the bucket 3-63 "
            "lowercase letters, digits, '.', '_' or '-', then a file's key (no '.' or '..' part, no trailing '/'; "
            "letters, digits and ._~:@+=%-)")


def is_bucket_uri(value: str) -> bool:
    """Whether a spec's path value names data in a bucket (s3://, gs://, r2://, cos://, oci://)."""
    return bool(re.match(r"^(s3|gs|r2|cos|oci)://", value))


def bucket_folder(uri: str) -> str:
    """The bucket folder a data URI's file is in (what a task copies onto the node): ``s3://b/dir`` for
    ``s3://b/dir/train.jsonl``, the bucket itself for a file at its top."""
    scheme, rest = uri.split("://", 1)
    head, _, _ = rest.rstrip("/").rpartition("/")
    return f"{scheme}://{head or rest}" if head else f"{scheme}://{rest}"


def mounted_bucket_path(uri: str) -> Path:
    """Where a task put the bucket data ``uri`` on this machine (:data:`DATA_MOUNTS_VAR`); FileNotFoundError naming
    the fix where no task did."""
    import json

    try:
        mounts = json.loads(os.environ.get(DATA_MOUNTS_VAR) or "{}")
    except ValueError:
        mounts = {}
    for folder, local in (mounts if isinstance(mounts, dict) else {}).items():
        if uri == folder or uri.startswith(folder.rstrip("/") + "/"):
            return Path(local) / uri[len(folder):].lstrip("/")
    raise FileNotFoundError(f"{uri} is in a bucket, and pilotrun reads files on this machine: copy it down (aws s3 "
                            "cp / gcloud storage cp) and give the local path (--set KEY=PATH); data in a bucket "
                            "(data.path) is copied onto the rented node by `pilotrun plan --skypilot`, and the pilot "
                            "there reads it")


def resolve_package_path(path: str) -> Path:
    """'pkg:NAME/sub/dir' → that folder inside the installed package NAME."""
    name, _, rest = path[len("pkg:"):].partition("/")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install it, or give a folder)")
    return Path(list(spec.submodule_search_locations)[0]) / rest


def resolve_path(path: str, folder: Path) -> Path:
    """A path from the spec, relative to ``folder`` (the spec file's); 'pkg:' paths inside packages; a bucket URI
    where a task put it on this machine. Raises FileNotFoundError for a 'pkg:' path whose package is not installed
    and a bucket URI no task put here."""
    if path.startswith("pkg:"):
        return resolve_package_path(path)
    if is_bucket_uri(path):
        return mounted_bucket_path(path)
    p = Path(path).expanduser()
    return p if p.is_absolute() else folder / p


# A path a spec names, as written: far above any real one and below Linux's PATH_MAX (4096 bytes, the spec's folder
# joined in front); each part at most NAME_MAX (255 bytes). Beyond them stat() raises ENAMETOOLONG, which no check
# expects; a NUL raises ValueError.
PATH_VALUE_MAX = 1024
PART_MAX_BYTES = 255


def path_value_problem(value: str) -> str | None:
    """Why ``value`` cannot name a file on any filesystem (a NUL byte, too long, a part too long, not encodable as a
    file name), from the text alone, before anything stats it; None when it can."""
    shown = repr(value) if len(value) <= 60 else f"{value[:60]!r}… ({len(value)} characters)"
    if "\0" in value:
        return f"contains a NUL byte, which no file name may hold: {shown}"
    if len(value) > PATH_VALUE_MAX:
        return f"is {len(value)} characters long; a path here may be at most {PATH_VALUE_MAX}: {shown}"
    try:
        parts = os.fsencode(value).split(b"/")
    except UnicodeError:
        return f"cannot be encoded as a file name on this system: {shown}"
    if any(len(part) > PART_MAX_BYTES for part in parts):
        return f"has a folder or file name longer than {PART_MAX_BYTES} bytes (the filesystem's limit): {shown}"
    return None


def looks_local(value: str) -> bool:
    """Whether a model or tokenizer value names a path (which must exist) rather than a Hub id."""
    return value.startswith(("pkg:", ".", "/", "~")) or not HUB_ID_RE.match(value)


# program.files' patterns are walked by spec_glob, never glob.glob: glob's ** follows every link to a folder, so a
# link to / in the spec's folder had the lock gate hash the whole filesystem for minutes.
GLOB_MAX_ENTRIES = 100_000  # entries listed for one pattern: a program's folder holds hundreds
GLOB_MAX_DEPTH = 32  # folders ** descends


class GlobRefused(ValueError):
    """A pattern that names a path outside its folder, or reaches more than the walk's bounds; the message says
    which and the fix."""


@dataclass
class Globbed:
    files: list[Path]  # regular files (links to files included) the pattern matches, named under the folder, sorted
    links_out: list[Path]  # links to folders outside the folder that ** passed by without entering
    named_out: list[Path]  # links to folders outside the folder that the pattern's own words lead through


class _Walk:
    def __init__(self, folder: Path, pattern: str) -> None:
        self.root, self.pattern = folder.resolve(), pattern
        self.entries, self.seen = 0, {folder.resolve()}
        self.links_out: list[Path] = []
        self.named_out: list[Path] = []

    def listed(self, d: Path, seg: str) -> list[Path]:
        """The entries of ``d`` that ``seg`` matches (glob's rule: a name starting with '.' only if ``seg`` does)."""
        names = []
        try:
            with os.scandir(d) as listing:
                for entry in listing:  # counted as read: one folder of millions is refused at the bound, not after
                    self.entries += 1
                    if self.entries > GLOB_MAX_ENTRIES:
                        raise GlobRefused(f"{self.pattern!r} lists more than {GLOB_MAX_ENTRIES} files and folders "
                                          f"under {self.root}; give narrower patterns (e.g. src/**/*.py)")
                    names.append(entry.name)
        except OSError:
            return []
        names.sort()
        hidden_too = seg.startswith(".")
        return [d / n for n in names if (hidden_too or not n.startswith(".")) and fnmatch.fnmatchcase(n, seg)]

    def enterable(self, d: Path, named: bool) -> bool:
        """Whether the walk goes into ``d``: a folder, and through a link only when it stays inside the root
        (``named``: the pattern's own segment led there, not **)."""
        if not d.is_dir():
            return False
        if d.is_symlink() and not d.resolve().is_relative_to(self.root):
            (self.named_out if named else self.links_out).append(d)
            return False
        return True

    def expand(self, d: Path, segs: list[str], depth: int = 0) -> Iterator[Path]:
        if not segs:
            yield d
            return
        seg, rest = segs[0], segs[1:]
        if seg == "**":
            if depth > GLOB_MAX_DEPTH:
                raise GlobRefused(f"{self.pattern!r} goes more than {GLOB_MAX_DEPTH} folders deep under {self.root}; "
                                  "give narrower patterns")
            yield from self.expand(d, rest, depth)  # ** as no folder at all
            for child in self.listed(d, "*"):
                if self.enterable(child, named=False):
                    real = child.resolve()
                    if real not in self.seen:  # a link back up inside the folder is entered once
                        self.seen.add(real)
                        yield from self.expand(child, segs, depth + 1)
                elif not rest:
                    yield child
            return
        children = self.listed(d, seg) if glob.has_magic(seg) else [d / seg]
        for child in children:
            if not rest:
                yield child
            elif self.enterable(child, named=True):
                yield from self.expand(child, rest, depth)


def spec_glob(folder: Path, pattern: str) -> Globbed:
    """The files ``pattern`` (glob syntax, ``**`` any folders; relative to ``folder``) matches, as ``glob.glob`` in
    ``folder`` would find them, except: a link to a folder outside ``folder`` is never entered (named in
    ``links_out``, or in ``named_out`` when the pattern's own words lead through it), a folder reached twice through
    links is listed once, and the walk is bounded (GLOB_MAX_ENTRIES, GLOB_MAX_DEPTH). GlobRefused for a pattern that
    is absolute or climbs with '..', or that exceeds a bound."""
    if os.path.isabs(pattern) or ".." in Path(pattern).parts:
        raise GlobRefused(f"{pattern!r} names a path outside {folder}: give a pattern relative to that folder")
    walk = _Walk(folder, pattern)
    segs = [s for s in pattern.split("/") if s not in ("", ".")]
    found = {p for p in walk.expand(folder, segs) if p.is_file()}
    return Globbed(sorted(found), walk.links_out, walk.named_out)
