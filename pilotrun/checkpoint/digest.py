"""The digests a manifest records for its files, and the one that names a manifest itself.

A manifest entry names its algorithm by its key: ``{"blake3": "<hex>", "bytes": n}`` (checkpoints since issue 25) or
``{"sha256": "<hex>", "bytes": n}`` (every manifest before, exports, and what a hand-rebuilt one usually carries).
Each entry is verified with the algorithm it names, so a folder written before the change still verifies, and one
entry carries exactly one digest: two would leave the reader to pick which one to believe.

A checkpoint's files are hashed with BLAKE3: on the 2-core dev VM one thread hashes 3.85 GB/s against sha256's
1.74 GB/s (``bench/digest_speed.py``, ``bench/results/digest_speed-cpu-2026-12-02.json``), and a save hashing with
it while it writes stays under a durable ``torch.save`` of the same state (``bench/save_overhead.py``). Exports keep
sha256: the archive's ``rerun_control.py`` checks them with nothing but hashlib.

The *identity* of a folder is another matter: the ledger records the sha256 of the ``manifest.json`` bytes
(:func:`pilotrun.checkpoint.trust.manifest_sha256`, the save and export rows, the archive's ``run.json``), and every
reader computes it the same way. It stays sha256 whatever the files are hashed with.
"""
from __future__ import annotations

import hashlib
from enum import Enum
from pathlib import Path
from typing import Any

import blake3


class Digest(str, Enum):
    """A file digest a manifest entry may carry; the entry's key is the member's value."""

    SHA256 = "sha256"
    BLAKE3 = "blake3"


CHECKPOINT_DIGEST = Digest.BLAKE3  # what a checkpoint's manifest records for its files
IDENTITY = Digest.SHA256  # the manifest's own digest, the ledger's "known": never changes
READ_CHUNK = 8 << 20


def hasher(algo: Digest) -> Any:
    """A fresh hash object with ``update``/``hexdigest`` (both release the GIL on large buffers)."""
    if algo is Digest.BLAKE3:
        # One thread per file: the save already writes several shards at once, one per core.
        return blake3.blake3()
    return hashlib.sha256()


def entry(algo: Digest, hexdigest: str, size: int) -> dict:
    return {algo.value: hexdigest, "bytes": size}


def entry_digest(info: Any) -> tuple[Digest, str] | None:
    """(algorithm, hex digest) of a well-formed manifest entry; None for anything else (no digest, two digests, a
    size that is not a whole number)."""
    if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or isinstance(info.get("bytes"), bool):
        return None
    found = [(algo, info[algo.value]) for algo in Digest if algo.value in info]
    if len(found) != 1 or not isinstance(found[0][1], str):
        return None
    return found[0]


def file_digest(path: Path, algo: Digest) -> str:
    """``algo`` of a file's bytes, read in chunks."""
    h = hasher(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(READ_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def matches(path: Path, info: dict) -> bool:
    """Whether the file's bytes hash to what its (well-formed) manifest entry records."""
    found = entry_digest(info)
    if found is None:
        return False
    algo, want = found
    return file_digest(path, algo) == want
