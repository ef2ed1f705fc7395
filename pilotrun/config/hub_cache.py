"""Where a spec's tokenizer is: a local file or folder, or a Hub id already in the local Hugging Face cache.

pilotrun never downloads a tokenizer: a Hub id (``tokenizer: gpt2``) is looked up in the cache with
``huggingface_hub.snapshot_download(local_files_only=True)`` — the same cache and layout ``model.hf`` reads through
transformers — and loaded from that snapshot folder. When neither a path nor a cached id exists, the message names
the field and how to get a local tokenizer (README, "Tokenizers").

Example::

    source = locate_tokenizer("gpt2", spec.resolve, revision=None)
    source.path   # .../hub/models--gpt2/snapshots/<commit>
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The files that make a tokenizer (transformers' fast/slow tokenizer formats); only these are required from a
# cached snapshot and hashed into the lock — a model repo's weights beside them are not the tokenizer.
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "*.tiktoken")
# At least one of these must be present: without them there is nothing to tokenize with.
TOKENIZER_CORE = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "*.tiktoken")
HOW_TO = ("on a machine with network, save it to a folder (AutoTokenizer.from_pretrained(ID).save_pretrained("
          "'tokenizer')) and copy that folder beside the spec (model.tokenizer: tokenizer), or download it into a "
          "Hugging Face cache (hf download ID) and copy the cache here or point HF_HUB_CACHE at it; or train your "
          "own as examples/tiny-sft/make_data.py does; README, \"Tokenizers\"")


class TokenizerNotFound(Exception):
    """Neither a local file/folder nor a cached Hub id; the message says where it looked and how to get one."""


@dataclass(frozen=True)
class TokenizerSource:
    path: Path                 # a tokenizer.json file, a local folder, or the cached snapshot folder
    hub_id: str | None = None  # set when it came from the Hugging Face cache
    commit: str | None = None  # the cached snapshot's commit

    def is_tokenizer_file(self, name: str) -> bool:
        """Whether a file of :attr:`path` belongs to the tokenizer (a local folder is the user's: all of it)."""
        return self.hub_id is None or any(fnmatch.fnmatch(name, p) for p in TOKENIZER_PATTERNS)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (default branch when None), or None; offline.
    Raises :class:`TokenizerNotFound` when the snapshot is there but lacks tokenizer files the repo has."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True,
                                      allow_patterns=list(TOKENIZER_PATTERNS)))
    except IncompleteSnapshotError as exc:  # in the cache, but a tokenizer file the repo lists is missing
        raise TokenizerNotFound(f"the cached snapshot of {repo_id!r} is incomplete: {exc}") from None
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def locate_tokenizer(value: str, resolve: Callable[[str], Path], revision: str | None = None,
                     hub_id_like: bool = True) -> TokenizerSource:
    """Where ``value`` (``model.tokenizer``, or ``model.hf`` standing in for it) is. A path beside the spec wins
    over a Hub id of the same name. Raises :class:`TokenizerNotFound`."""
    try:
        local: Path | None = resolve(value)
    except FileNotFoundError:
        local = None
    if local is not None and local.exists():
        return TokenizerSource(local)
    where = f"no file or folder {local} (paths are relative to the spec's folder)" if local else f"{value!r} not found"
    if not hub_id_like:
        raise TokenizerNotFound(f"{where}; {HOW_TO.replace('ID', repr(value))}")
    try:
        snapshot = cached_snapshot(value, revision)
    except TokenizerNotFound as exc:
        raise TokenizerNotFound(f"{where}, and {exc}; {HOW_TO.replace('ID', repr(value))}") from None
    if snapshot is None:
        at = f" at revision {revision!r}" if revision else ""
        raise TokenizerNotFound(
            f"{where}, and {value!r}{at} is not in the local Hugging Face cache ({hub_cache_dir()}; pilotrun never "
            f"downloads): {HOW_TO.replace('ID', repr(value))}")
    names = [p.name for p in snapshot.iterdir()]
    if not any(fnmatch.fnmatch(n, p) for n in names for p in TOKENIZER_CORE):
        raise TokenizerNotFound(
            f"{where}; the cached snapshot of {value!r} ({snapshot}) has no tokenizer files "
            f"({', '.join(TOKENIZER_CORE)}): {HOW_TO.replace('ID', repr(value))}")
    return TokenizerSource(snapshot, hub_id=value, commit=snapshot.name)
