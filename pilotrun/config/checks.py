"""What a spec must satisfy beyond each section's own types and checks: the files and folders it names exist and
can be read, ``model.config``'s keys belong to its architecture, the factories import, and the keys of different
sections agree. Every problem is ``(dotted.field, message)`` and the message says the fix.

Example::

    problems = spec_problems(spec, data_files=True)   # [] when the spec can run here
"""
from __future__ import annotations

import sys
from pathlib import Path

from .exitguard import ExitCalled
from .factories import FactoryInterrupt, FactoryTimeout, ShadowedModule, factory_guard, import_factory
from .hub_cache import TokenizerNotFound
from .paths import looks_local
from .sections import AUTOCAST_DTYPE, ModelSpec
from .spec import Spec
from .yamlsafe import regular_file_problem

Problems = list[tuple[str, str]]


def spec_problems(spec: Spec, data_files: bool = True) -> Problems:
    """Every problem of a validated spec that only its surroundings or several sections reveal. ``data_files=False``
    skips the data and tokenizer files (estimate/select/plan read neither)."""
    problems = []
    if spec.model.config is not None:
        problems += model_config_problems(spec.model)
    problems += path_problems(spec, data_files)
    if data_files:
        problems += tokenizer_problems(spec)
    for section, target in (("model", spec.model.factory), ("data", spec.data.factory)):
        if target is not None and (problem := factory_problem(target, spec.folder,
                                                              spec.pilot.factory_timeout)) is not None:
            problems.append((f"{section}.factory", problem))
    return problems + cross_section_problems(spec)


def model_config_problems(model: ModelSpec) -> Problems:
    """transformers accepts any key into a config and ignores the misspelt ones: a typo would silently
    estimate or train another model. Every key must be a field of that architecture's config."""
    import difflib
    import inspect as _inspect

    cfg = model.config or {}
    model_type = cfg.get("model_type")
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    if not isinstance(model_type, str):
        return [("model.config.model_type", f"expected a string naming an architecture (e.g. 'llama', 'bert'), got "
                 f"{type(model_type).__name__} {str(model_type)[:60]}")]
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        return [("model.config.model_type", f"unknown architecture {model_type!r}{hint}")]
    cls = CONFIG_MAPPING[model_type]
    known = set(_inspect.signature(cls.__init__).parameters) | set(PretrainedConfig().to_dict())
    try:
        known |= set(cls().to_dict())
    except Exception:  # some configs need arguments to build a default
        pass
    known |= set(getattr(cls, "attribute_map", {}) or {})
    # Generation settings a model config still carries and its forward reads (T5's decoder_start_token_id, in every
    # t5 config.json and so in a described T5 program's config): not typos, though newer configs no longer list them.
    from transformers import GenerationConfig

    known |= set(GenerationConfig().to_dict())
    problems = []
    for key in cfg:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((f"model.config.{key}",
                             f"not a field of {cls.__name__}{hint} (transformers would ignore it)"))
    return problems


def _place_problem(spec: Spec, value: str, kind: str) -> str | None:
    """Why the file or folder ``value`` names cannot be read, or None. ``kind`` is what it must be (file or
    folder; a file's first byte is read, a folder is only found)."""
    try:
        p = spec.resolve(value)
    except FileNotFoundError as exc:
        return str(exc)
    if not p.exists():
        return f"{kind} not found: {p} (paths are relative to the spec's folder)"
    if not p.is_dir() and (not_regular := regular_file_problem(p)) is not None:
        # A FIFO or a device would block or never end when read: refused from stat() alone, never opened.
        return f"{not_regular}; give a file or a folder"
    if kind == "file" and p.is_dir():
        return f"expected a file, got a folder: {p}"
    if p.is_file():
        try:
            with open(p, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            return f"cannot read {p}: {exc.strerror}"
    return None


def path_problems(spec: Spec, data_files: bool) -> Problems:
    """data.path's files (when ``data_files``) and a local model.hf folder exist and can be read."""
    places: list[tuple[str, str, str]] = []  # (field, value, kind)
    if isinstance(spec.data.path, str) and data_files:
        places.append(("data.path", spec.data.path, "file"))
    elif isinstance(spec.data.path, dict) and data_files:
        places += [(f"data.path.{split}", value, "file") for split, value in spec.data.path.items()]
    if spec.model.hf is not None and looks_local(spec.model.hf):
        places.append(("model.hf", spec.model.hf, "folder"))
    return [(name, problem) for name, value, kind in places
            if (problem := _place_problem(spec, value, kind)) is not None]


def tokenizer_problems(spec: Spec) -> Problems:
    """model.tokenizer is found, and built-in tasks (which tokenize text) have a tokenizer at all."""
    m = spec.model
    if m.tokenizer is not None:
        try:
            spec.tokenizer_source()
        except TokenizerNotFound as exc:
            return [("model.tokenizer", str(exc))]
    if spec.data.task is None or m.tokenizer is not None:
        return []
    if m.factory is None and m.hf is None:
        return [("model.tokenizer", "missing; built-in tasks with model.config need a tokenizer folder or "
                 "tokenizer.json")]
    if m.factory is not None:
        return [("model.tokenizer", "missing; built-in tasks tokenize text, so a factory model needs "
                 "model.tokenizer")]
    return []


def factory_problem(target: str, folder: Path, timeout: float | None = None) -> str | None:
    """Why the factory 'module:function' cannot be used (it does not import within ``timeout`` seconds, or is not
    callable), or None."""
    try:
        with factory_guard(f"importing {target!r}", timeout):
            fn = import_factory(target, folder)
    except (ShadowedModule, FactoryTimeout, FactoryInterrupt) as exc:
        return str(exc)
    except ModuleNotFoundError as exc:
        return f"cannot import {target!r}: {exc} (modules are imported from {folder})"
    except AttributeError:
        mod = sys.modules.get(target.partition(":")[0])
        where = f" ({getattr(mod, '__file__', None) or 'built-in'})" if mod is not None else ""
        return f"{target!r}: the module{where} has no attribute {target.partition(':')[2]!r}"
    except ExitCalled as exc:  # os._exit while importing (cli installs the guard)
        return (f"importing {target!r} called os._exit({exc.code!r}); a factory module must not end the process "
                "when imported (raise an exception instead)")
    except SystemExit as exc:  # the user's module exits while importing
        return (f"importing {target!r} called sys.exit({exc.code!r}); a factory module must not exit when imported "
                "(raise an exception instead)")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's module raised while importing (any BaseException subclass)
        return f"importing {target!r} raised {type(exc).__name__}: {exc}"
    return None if callable(fn) else f"{target!r} is not callable"


def cross_section_problems(spec: Spec) -> Problems:
    """Keys of different sections that contradict each other where the section checks cannot see both."""
    problems = []
    if AUTOCAST_DTYPE.get(spec.train.precision) == "bf16" and spec.train.device == "mps":
        problems.append(("train.precision", "bf16 autocast is not supported on mps; use fp16 or fp32"))
    ml, eml = spec.data.max_length, spec.eval.max_length
    if ml is not None and eml is not None and eml < ml:
        problems.append(("eval.max_length", f"{eml} is shorter than data.max_length {ml}; evaluation would not see "
                         "the training length"))
    return problems
