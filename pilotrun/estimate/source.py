"""How many bytes of model the rented node must fetch, following the spec's model source.

* ``model.config``: built with random weights on the node, nothing to download;
* ``model.hf`` naming a local folder or file: the size of its files (they are copied to the node);
* ``model.hf`` naming a Hub id: the size of that revision's files in the local Hugging Face cache
  (a snapshot holds exactly the revision's files); not measured when the revision is not cached, since
  pilotrun never asks the Hub on its own (``plan --model-gb`` gives the size);
* ``model.factory``: your code builds the model, so only you know what it loads (``--model-gb``).

Example::

    d = model_download(spec)            # {"bytes": 0, "source": "config", "reason": "..."}
    d = model_download(spec, given_gb=13.5)
"""
from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path

from ..config.spec import Spec

COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelSource(str, Enum):
    CONFIG = "config"
    LOCAL = "local"
    HUB = "hub"
    FACTORY = "factory"
    GIVEN = "given"


def _files_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) under a folder or of one file; symlinks followed (the Hub cache links into blobs/)."""
    if root.is_file():
        return 1, root.stat().st_size
    count = total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                total += (Path(dirpath) / name).stat().st_size
                count += 1
            except OSError:  # a dangling link in a half-downloaded snapshot: not a file the node fetches
                continue
    return count, total


def hub_snapshot(repo_id: str, revision: str | None, hub_cache: Path | None = None) -> tuple[Path | None, str]:
    """The local cache folder of ``repo_id`` at ``revision`` (a commit, a branch or None for main), and the
    commit it resolved to; (None, reason) when it is not cached."""
    if hub_cache is None:
        from huggingface_hub import constants

        hub_cache = Path(constants.HF_HUB_CACHE)
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        return None, f"{repo_id} is not in the local Hugging Face cache ({hub_cache})"
    rev = revision or "main"
    if COMMIT.match(rev):
        commit = rev
    else:
        ref = repo / "refs" / rev
        if not ref.is_file():
            return None, f"{repo_id}: revision {rev!r} is not in the local Hugging Face cache"
        commit = ref.read_text().strip()
    snap = repo / "snapshots" / commit
    if not snap.is_dir():
        return None, f"{repo_id}: commit {commit[:12]} is not in the local Hugging Face cache"
    return snap, commit


def model_download(spec: Spec, given_gb: float | None = None, hub_cache: Path | None = None) -> dict:
    """{"bytes": int | None, "source": ModelSource, "reason": str}; bytes None means not measured."""
    m = spec.model
    if given_gb is not None:
        return {"bytes": int(given_gb * 1e9), "source": ModelSource.GIVEN, "reason": f"{given_gb:g} GB (--model-gb)"}
    if m.factory is not None:
        return {"bytes": None, "source": ModelSource.FACTORY,
                "reason": f"not measured: model.factory {m.factory} builds the model in your code; give what it "
                          "downloads with --model-gb"}
    if m.config is not None:
        return {"bytes": 0, "source": ModelSource.CONFIG,
                "reason": "model.config builds the model with random weights on the node: no weights to download"}
    assert m.hf is not None
    try:
        local = spec.resolve(m.hf)
    except OSError:
        local = None
    if local is not None and local.exists():
        files, size = _files_bytes(local)
        return {"bytes": size, "source": ModelSource.LOCAL,
                "reason": f"model.hf {m.hf}: {files} local file(s), {size / 1e9:.2f} GB, copied to the node"}
    snap, how = hub_snapshot(m.hf, m.revision, hub_cache)
    if snap is None:
        return {"bytes": None, "source": ModelSource.HUB,
                "reason": f"not measured: {how}, and pilotrun does not ask the Hub; give the size with --model-gb"}
    files, size = _files_bytes(snap)
    return {"bytes": size, "source": ModelSource.HUB,
            "reason": f"Hub {m.hf}@{how[:12]}: {files} file(s), {size / 1e9:.2f} GB (sizes from the local Hugging "
                      "Face cache)"}
