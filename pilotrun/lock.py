"""What a run depends on (docs/architecture.md, "Contracts": lock), recorded so a later run can report drift field
by field.

:func:`collect_lock` is a function from a spec (and the environment) to a plain
dict; :func:`diff_locks` compares two of them. Neither prints anything.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import site
import subprocess
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from . import __version__, backends
from .config.factories import import_factory
from .config.paths import bucket_folder, is_bucket_uri, looks_local
from .config.program import program_files
from .config.spec import Spec, dotted
from .errors import ContainerDigestError as ContainerDigestError  # defined there: the CLI catches it without torch

CONTAINER_ENV = "PILOTRUN_CONTAINER_DIGEST"
CONTAINER_FLAG = "--container-digest"
# An image digest as `docker inspect` / `podman inspect` print it (RepoDigests): the content address of the image,
# optionally after the image name, e.g. ghcr.io/org/img@sha256:<64 hex>. A tag or a short id is not a digest.
DIGEST_RE = re.compile(r"^(?:[\w.\-/:]+@)?sha256:[0-9a-f]{64}$")
DIGEST_FORMAT = "sha256:<64 lowercase hex digits> (optionally image@sha256:...)"
# Fields that identify the machine, not the job: recorded, never reported as drift.
# Where it ran, not what ran: the machine, and the folder a program's spec is in (a rented node's is another).
NOT_DRIFT = ("created_at", "host.", "program.folder")
# The device runtime's libraries (backends' versions): present on one machine and absent on another is the device.
RUNTIME_LIBRARIES = ("versions.cuda", "versions.hip", "versions.cudnn", "versions.nccl")
# Distributions that are a torch build's own runtime (CUDA's nvidia-* wheels, Triton): they come with the build.
RUNTIME_PACKAGE = re.compile(r"^(nvidia-.+|triton|pytorch-triton(-.+)?)$")
ABSENT = "<absent>"


class DriftKind(str, Enum):
    """Why a lock field differs from the last run's. The lock gate reports the two differently."""

    EXPERIMENT = "experiment"    # the user changed the config (a key they vary on purpose): information
    CODE = "code"                # the program's files, a factory's module, the git commit were edited: information
    ENVIRONMENT = "environment"  # versions, container, model/data content moved under one config: a warning
    # The same releases built for another device (torch 2.13.0+cpu -> 2.13.0+cu128, CUDA's libraries and wheels
    # present on one side only): what a pilot proven on a laptop and run again on the rented node shows. Information.
    DEVICE = "device"

    def __str__(self) -> str:
        return str(self.value)


def resolve_container_digest(flag_value: str | None = None) -> tuple[str | None, str | None]:
    """The container digest and where it came from (the flag wins over ``$PILOTRUN_CONTAINER_DIGEST``).

    ``(None, None)`` when neither is set. Raises :class:`ContainerDigestError` naming the flag or the variable
    when a value is given that is not an image digest: a made-up value would be recorded as if it pinned the image.
    """
    for value, source in ((flag_value, CONTAINER_FLAG), (os.environ.get(CONTAINER_ENV), f"${CONTAINER_ENV}")):
        if not value:
            continue
        if not DIGEST_RE.match(value.strip()):
            raise ContainerDigestError(
                f"{source} is {value!r}, which is not an image digest: expected {DIGEST_FORMAT}, e.g. from "
                "`docker inspect --format '{{index .RepoDigests 0}}' IMAGE`; unset it when not in a container")
        return value.strip(), source
    return None, None


def sha256_file(path: Path, cache: dict | None = None) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if cache is not None and key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[key] = digest
    return digest


def hash_tree(root: Path, cache: dict | None = None, keep: Callable[[str], bool] | None = None) -> dict:
    """sha256 per file under ``root`` (or of ``root`` itself) and one combined digest; ``keep(name)`` filters."""
    files = ([root] if root.is_file()
             else sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                         and (keep is None or keep(p.name))))
    per_file = {}
    for p in files:
        rel = p.name if root.is_file() else str(p.relative_to(root))
        per_file[rel] = sha256_file(p, cache)
    combined = hashlib.sha256(json.dumps(per_file, sort_keys=True).encode()).hexdigest()
    return {"path": str(root), "files": per_file, "sha256": combined}


def _data_file(spec: Spec, value: str, cache: dict | None) -> dict:
    """A data file's hashes; one a task copied from a bucket also says its URI and its bucket folder's listing
    digest (every file's name and size there, as the node got them), the data this node's pilot proved."""
    bucket = is_bucket_uri(value)
    try:
        local = spec.resolve(value)
    except FileNotFoundError:
        if not bucket:
            raise
        # No task copied it here (a plan's lock, taken before the node reads the bucket).
        return {"path": value, "uri": value, "bucket_folder": bucket_folder(value), "sha256": None,
                "not_read": "in a bucket: read where a task copies it (the node's pilot records its hashes)"}
    out = hash_tree(local, cache)
    if bucket:
        folder = local.parent
        listing = sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())
        out.update(uri=value, bucket_folder=bucket_folder(value), listing_files=len(listing),
                   listing_sha256=hashlib.sha256(json.dumps(listing).encode()).hexdigest())
    return out


def _versions() -> dict:
    # The device runtimes' libraries (cuda, hip, cudnn, nccl) come from their backends, the same keys everywhere.
    return {"python": platform.python_version(), "torch": torch.__version__, **backends.build_versions()}


def _installed_paths() -> list[str]:
    # What is installed, not what this process has imported: some packages put their vendored copies on sys.path
    # when imported (ray adds ray/thirdparty_files, whose colorama made a campaign resumed from a fresh process
    # refuse every run as drifted). A sys.path entry inside a site directory is such a copy, so it is left out.
    sites = [os.path.realpath(s) for s in (*site.getsitepackages(), site.getusersitepackages())]
    inside = [s + os.sep for s in sites]
    return [p for p in sys.path if not any(os.path.realpath(p or ".").startswith(i) for i in inside)]


def installed_distributions() -> dict[str, str]:
    """Every installed distribution (normalised name -> version), as the lock records them."""
    return _distributions()


def read_distributions() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """:func:`installed_distributions`, and ``(file, why)`` for each distribution whose metadata could not be read
    (not UTF-8, no permission): its name and version are unknown, so the file is what can be named."""
    out, unreadable = {}, []
    for dist in importlib.metadata.distributions(path=_installed_paths()):
        try:
            name, version = dist.metadata["Name"], dist.version
        except UnicodeDecodeError as exc:
            unreadable.append((_metadata_file(dist), f"not UTF-8 text (byte {exc.start}: {exc.reason})"))
            continue
        except OSError as exc:
            unreadable.append((_metadata_file(dist), f"cannot be read ({exc.strerror or exc})"))
            continue
        if name:
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return dict(sorted(out.items())), unreadable


def _metadata_file(dist: importlib.metadata.Distribution) -> str:
    # PathDistribution keeps its .dist-info (or .egg-info) folder in _path, with no public accessor for it.
    folder = getattr(dist, "_path", None)
    if folder is None:
        return str(dist)
    for name in ("METADATA", "PKG-INFO"):
        if (Path(str(folder)) / name).exists():
            return str(Path(str(folder)) / name)
    return str(folder)


def _distributions() -> dict:
    # A distribution whose metadata cannot be read is left out of the lock (a crash would end the run for a file
    # of another package); `pilotrun lock check` names it.
    return read_distributions()[0]


def _git(folder: Path) -> dict:
    def run(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status)}


def _factory_source(target: str, folder: Path, cache: dict | None) -> dict:
    fn = import_factory(target, folder)
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    if not path:
        return {"factory": target, "source_sha256": None}
    return {"factory": target, "file": os.path.relpath(path, folder), "source_sha256": sha256_file(Path(path), cache)}


def in_container() -> bool:
    return Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def collect_lock(spec: Spec, container_digest: str | None = None, cache: dict | None = None) -> dict:
    """Everything the run depends on, as plain JSON."""
    from datetime import datetime, timezone

    m = spec.model
    model: dict[str, Any]
    if m is None:  # a program-only spec (config.spec.ProgramOnlySpec): the program builds its own model and data
        model = {"source": "program"}
    elif m.factory is not None:
        model = {"source": "factory", **_factory_source(m.factory, spec.folder, cache)}
    elif m.config is not None:
        model = {"source": "config", "random_init_seed": spec.seed}
    elif m.hf is not None and looks_local(m.hf):
        model = {"source": "local", **hash_tree(spec.resolve(m.hf), cache)}
    else:
        pinned = bool(m.revision and re.fullmatch(r"[0-9a-f]{40}", m.revision))
        model = {"source": "hub", "id": m.hf, "revision": m.revision, "pinned": pinned}
    if m is not None and m.tokenizer is not None:
        tok = spec.tokenizer_source()
        model["tokenizer"] = hash_tree(tok.path, cache, tok.is_tokenizer_file)
        if tok.hub_id is not None:  # from the local Hugging Face cache: which repo and which commit
            model["tokenizer"].update(hub_id=tok.hub_id, commit=tok.commit)

    d = spec.data
    data: dict[str, Any]
    if d is None:
        data = {"source": "program"}
    elif d.factory is not None:
        data = {"source": "factory", **_factory_source(d.factory, spec.folder, cache)}
        files = {}
        for key, value in d.extra.items():
            if isinstance(value, str) and (spec.folder / value).exists():
                files[key] = hash_tree(spec.folder / value, cache)
        if files:
            data["files"] = files
    elif isinstance(d.path, str):
        data = {"source": "jsonl", **_data_file(spec, d.path, cache)}
    else:
        splits = d.path or {}
        data = {"source": "jsonl", "splits": {k: _data_file(spec, v, cache) for k, v in splits.items()}}

    container: dict[str, Any]
    digest, source = resolve_container_digest(container_digest)
    if digest:
        container = {"digest": digest, "from": source}
    else:
        container = {"digest": None, "from": None, "inside_container": in_container()}

    program = {} if spec.program is None else {"program": program_lock(spec, cache)}
    return {
        **program,
        "pilotrun": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": spec.canonical(),
        "config_hash": spec.config_hash(),
        "seeds": {"seed": spec.seed, "python": spec.seed, "numpy": spec.seed % 2**32, "torch": spec.seed,
                  "data_order": spec.seed, "model_init": spec.seed},
        "model": model,
        "data": data,
        "code": _git(spec.folder),
        "versions": _versions(),
        "distributions": _distributions(),
        "container": container,
        "host": {"machine": platform.machine(), "system": platform.system(), "node": platform.node()},
    }


def program_lock(spec: Spec, cache: dict | None = None) -> dict:
    """The program's command as written and as run, and the sha256 of its files (``program.files``, else the files
    its command names: the choice and its reason are recorded)."""
    assert spec.program is not None
    files, why = program_files(spec.program, spec.folder)
    hashed = {os.path.relpath(p, spec.folder): sha256_file(p, cache) for p in files}
    return {"command": spec.program.words, "folder": str(spec.folder), "files_from": why, "files": hashed,
            "sha256": hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()}


def diff_locks(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """``(field, old, new)`` for every dotted field that differs (machine identity excluded)."""
    a, b = dotted(old), dotted(new)
    # Bucket data one of the locks could not read (taken where no task had copied it): the other is the only one
    # to hash it, which is not a drift (the URI itself is in the config).
    unread = tuple(k[: -len("not_read")] for k in (*a, *b) if k.endswith(".not_read"))
    out = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(NOT_DRIFT) or (unread and key.startswith(unread)):
            continue
        if a.get(key, ABSENT) != b.get(key, ABSENT):
            out.append((key, a.get(key, ABSENT), b.get(key, ABSENT)))
    return out


def summarize_drift(drift: list[tuple[str, object, object]], limit: int = 6, sep: str = ": ") -> str:
    """``field: old -> new; ...`` with long values cut around where they differ (``sep`` goes between the field and
    its values): a changed command shows the words that changed, not its common start."""
    parts = []
    for key, old, new in drift[:limit]:
        o, n = _changed_part(json.dumps(old, default=str), json.dumps(new, default=str))
        parts.append(f"{key}{sep}{o} -> {n}")
    more = f" (+{len(drift) - limit} more)" if len(drift) > limit else ""
    return "; ".join(parts) + more


HEX64 = re.compile(r'^"[0-9a-f]{64}"$')


def _changed_part(old: str, new: str, width: int = 24) -> tuple[str, str]:
    """Two JSON texts cut to ``width`` around their first difference (a sha256 shortened to its first 12 digits)."""
    if HEX64.match(old) and HEX64.match(new):
        return old[1:13] + "…", new[1:13] + "…"
    if len(old) <= width and len(new) <= width:
        return old, new
    start = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    start = max(0, start - 8)

    def cut(text: str) -> str:
        piece = text[start:start + width]
        return ("…" if start else "") + piece + ("…" if start + width < len(text) else "")

    return cut(old), cut(new)


def summarize_code(code: list[tuple[str, object, object]]) -> str:
    """The edited files by name (``train.py edited, utils.py new``) and a moved commit, for the lock row."""
    said = []
    for key, old, new in code:
        if key.startswith("program.files."):
            name = key[len("program.files."):]
            said.append(f"{name} {'new' if old == '<absent>' else 'removed' if new == '<absent>' else 'edited'}")
        elif key.endswith("source_sha256"):
            said.append(f"the {key.split('.')[0]} factory's module edited")
        elif key == "code.commit":
            said.append(f"git commit {str(old)[:10]} -> {str(new)[:10]}")
        elif key == "code.dirty":
            said.append("uncommitted changes" + (" now" if new else " gone"))
    return ", ".join(said) or summarize_drift(code)


# Lock fields under model.* / data.* that say *where* a thing comes from; the others (sha256, files.*) are its content.
IDENTITY_FIELDS = ("source", "path", "id", "revision", "factory", "file", "hub_id", "uri", "bucket_folder")


def drift_kind(field: str, changed: set[str]) -> DriftKind:
    """Whether a drifted field is the experiment the user changed or the environment under it.

    ``changed`` is every drifted field (a content hash that moved because its path moved in the config is the
    experiment; the same path with other content is the environment)."""
    parts = field.split(".")
    if parts[0] in ("config", "config_hash", "seeds") or parts[-1].endswith("_seed"):  # model.random_init_seed
        return DriftKind.EXPERIMENT
    if parts[0] == "program":
        # The command is the config's program.command again (said once, as the config change); the files are code.
        return DriftKind.EXPERIMENT if parts[1:] == ["command"] else DriftKind.CODE
    if parts[0] == "code":
        return DriftKind.CODE
    if parts[0] in ("model", "data") and parts[-1] == "source_sha256" and not any(
            f"{parts[0]}.{name}" in changed for name in ("factory", "file")):
        return DriftKind.CODE  # the same factory's module was edited (whatever else of the section changed)
    if parts[0] in ("model", "data"):
        config_changed = any(k.startswith(f"config.{parts[0]}.") for k in changed)
        if parts[-1] in IDENTITY_FIELDS:
            return DriftKind.EXPERIMENT if config_changed else DriftKind.ENVIRONMENT
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth])
            if config_changed and any(f"{prefix}.{name}" in changed for name in IDENTITY_FIELDS):
                return DriftKind.EXPERIMENT
    return DriftKind.ENVIRONMENT


def _build_label(version: object) -> tuple[str, str | None] | None:
    if not isinstance(version, str):
        return None
    base, _, label = version.partition("+")
    return base, label or None


def is_device_build(field: str, old: object, new: object) -> bool:
    """Whether a drifted field is the same software built for another device: a runtime library or a runtime wheel
    present on one side only, or one release of a distribution under another build label where one side is a CPU
    (or unlabelled) build. CUDA 12.4 -> 12.8 on both sides is not: that is the environment drifting."""
    one_side = old in (None, ABSENT) or new in (None, ABSENT)
    if field in RUNTIME_LIBRARIES:
        return one_side
    name = field.split(".", 1)[1] if field.startswith("distributions.") else None
    if name is not None and RUNTIME_PACKAGE.match(name):
        return one_side
    if field == "versions.torch" or name is not None:
        a, b = _build_label(old), _build_label(new)
        return (a is not None and b is not None and a[0] == b[0] and a[1] != b[1]
                and (a[1] in (None, "cpu") or b[1] in (None, "cpu")))
    return False


def _moved_only(field: str, changed: set[str]) -> bool:
    """A model/data file's location (``data.path``: absolute, where this machine keeps it) moved while its content
    digest did not and the config names the same file: the same content elsewhere (a laptop's folder and the rented
    node's workdir), not drift."""
    parts = field.split(".")
    if parts[0] not in ("model", "data") or parts[-1] != "path":
        return False
    prefix = ".".join(parts[:-1])
    return f"{prefix}.sha256" not in changed and not any(k.startswith(f"config.{parts[0]}.") for k in changed)


def classify_drift(drift: list[tuple[str, object, object]]) -> dict[DriftKind, list[tuple[str, object, object]]]:
    """:func:`diff_locks`' output split by :class:`DriftKind` (every key always present)."""
    changed = {k for k, _, _ in drift}
    out: dict[DriftKind, list[tuple[str, object, object]]] = {kind: [] for kind in DriftKind}
    for item in drift:
        if _moved_only(item[0], changed):
            continue
        kind = DriftKind.DEVICE if is_device_build(*item) else drift_kind(item[0], changed)
        out[kind].append(item)
    return out


def config_changes(drift: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
    """The spec keys behind an experiment drift, as the user writes them (``train.micro_batch_size``): the hash,
    the derived seeds and the hashes of moved files are consequences, not changes of their own."""
    return [(k[len("config."):], a, b) for k, a, b in drift if k.startswith("config.")]
