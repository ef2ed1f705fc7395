"""Where a spec's path values point: relative to the spec file's folder, inside an installed package (``pkg:``),
or nowhere local (a Hugging Face Hub id).

Example::

    resolve_path("data/train.jsonl", spec.folder)   # spec.folder / "data/train.jsonl"
    looks_local("gpt2"), looks_local("./tokenizer")  # False, True
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# A Hub id is "name" or "org/name"; anything with more path parts, or that starts
# like a path, must exist on disk.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_package_path(path: str) -> Path:
    """'pkg:NAME/sub/dir' → that folder inside the installed package NAME."""
    name, _, rest = path[len("pkg:"):].partition("/")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install it, or give a folder)")
    return Path(list(spec.submodule_search_locations)[0]) / rest


def resolve_path(path: str, folder: Path) -> Path:
    """A path from the spec, relative to ``folder`` (the spec file's); 'pkg:' paths inside packages. Raises
    FileNotFoundError for a 'pkg:' path whose package is not installed."""
    if path.startswith("pkg:"):
        return resolve_package_path(path)
    p = Path(path).expanduser()
    return p if p.is_absolute() else folder / p


def looks_local(value: str) -> bool:
    """Whether a model or tokenizer value names a path (which must exist) rather than a Hub id."""
    return value.startswith(("pkg:", ".", "/", "~")) or not HUB_ID_RE.match(value)
