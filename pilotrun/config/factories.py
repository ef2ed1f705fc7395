"""Importing a user's ``model.factory`` / ``data.factory`` ("module:function") from the spec's folder.

The folder goes first on ``sys.path``, so a module beside the spec wins over an installed one of the same name;
a module of that name imported earlier from elsewhere (often the standard library) is :class:`ShadowedModule`.
Two specs in one process (campaigns, tests) each get their own folder's module (README, "Your own model and
data").

Example::

    build = import_factory("toy:build_model", spec.folder)
    model = build(spec.model.factory_mapping())
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


class ShadowedModule(ImportError):
    """A module beside the spec has the name of a module Python already imported from elsewhere."""


_FACTORY_MODULES: dict[str, Path] = {}  # top-level module name -> spec folder it was imported from


def _forget_other_folder(top: str, folder: Path) -> None:
    """Drop another spec folder's module of the same top-level name, so that this folder's own is imported."""
    previous = _FACTORY_MODULES.get(top)
    if previous is not None and previous != folder:
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
        if str(previous) in sys.path:
            sys.path.remove(str(previous))


def import_factory(target: str, folder: Path) -> Any:
    """Import 'module:function' relative to the spec folder (README, "Your own model and data"). Raises what the
    import raises (ModuleNotFoundError, AttributeError, the module's own errors) or :class:`ShadowedModule`."""
    module_name, _, func_name = target.partition(":")
    top = module_name.split(".")[0]
    _forget_other_folder(top, folder)
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    module = importlib.import_module(module_name)
    local = [folder / f"{top}.py", folder / top / "__init__.py"]
    top_file = getattr(sys.modules.get(top), "__file__", None) or "built-in"
    if any(x.exists() for x in local) and (top_file == "built-in"
                                           or not Path(top_file).resolve().is_relative_to(folder.resolve())):
        raise ShadowedModule(
            f"{top!r} resolved to {top_file}, not to {next(x for x in local if x.exists())}: a module of that name was "
            f"already imported (often the standard library); rename your file"
        )
    _FACTORY_MODULES[top] = folder
    obj = module
    for part in func_name.split("."):
        obj = getattr(obj, part)
    return obj
