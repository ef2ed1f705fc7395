"""Traces kept on disk, so that estimate, select and plan of one job trace it once.

A trace of a 7B-shaped job takes 13 s on a quiet 2-core machine and minutes on a busy one; its result
depends only on what is in the key below. Entries are JSON (never pickle: a cache file must not be able to
run code), one file per key under ``$PILOTRUN_CACHE/traces`` or ``~/.cache/pilotrun/traces``.

The key holds what the trace reads: the spec's model section, the data section (and, for a data factory,
the factory's files), the train sizes, optimizer (not its learning rate), loss normalisation and compile, the
evaluation sizes, the strategy, the seed, the trace's own options (target, checkpointing, precision, micro
batch, length) and the versions of pilotrun, torch and transformers. Files the spec names (factories, a
local model folder's config, a factory's data files) enter by size and modification time, not content:
hashing a dataset on every call would cost what the cache saves.

Example::

    cache = TraceCache.default()
    key = trace_key(spec, "cuda", ac=True, precision="bf16")
    hit = cache.get(key)          # CacheRead: trace or None, and a note saying what happened
    cache.put(key, trace, "2026-12-01T03:46:29Z")   # a note when the entry could not be written
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .. import __version__
from ..config.spec import Spec
from ..ledger.records import GateName
from ..safefile import FileKind, FileProblem, MapOf, NonNegative, Optional, check, read_json

CACHE_ENV = "PILOTRUN_CACHE"
# A trace's fsdp_parts (estimate/adapted.fsdp_parts), per block, root and model: the bytes of each kind.
FSDP_PART_KINDS = ("fp32", "stored", "state", "trainable")
FORMAT = 11  # bump when TraceResult's fields change meaning: older entries are then simply other keys (3: adapters,
#             4: each op's FLOPs and bytes for the time model, 5: out= writes, whole kernels, the norm before the step,
#             6: attention as the target's kernel runs it, per-op checkpointing with a matmul stride,
#             7: the attention kernels' op rows apart, for the time at the data's lengths,
#             8: the experts' grouped matmuls counted (estimate/moe.py): an older MoE trace counted them zero,
#             9: train.compile's facts (estimate/compiled.py): an eager trace never answers for a compiled job,
#             10: a cache handed to a block by position dropped (GPT-2's compiled block was "not modelled"), and the
#             matmuls whose dimensions leave the tensor cores' alignment (ops.OpCosts.unaligned_rows),
#             11: parameter bytes as FSDP2 moves them (adapted.fsdp_parts): fp32, as stored, quantisation state,
#             trainable)


def default_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "pilotrun") / "traces"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _file_stamp(path: Path) -> dict:
    try:
        st = path.stat()
    except OSError:
        return {"missing": True}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _resolve(spec: Spec, path: str) -> Path | None:
    try:
        return spec.resolve(path)
    except OSError:  # a 'pkg:' path whose package is not installed: the trace itself will say so
        return None


def _named_files(spec: Spec) -> dict[str, dict]:
    """Files beside the spec whose contents a trace reads: factory code, a local model config, factory data."""
    folder = spec.folder
    files: dict[str, dict] = {}
    if spec.model.factory or spec.data.factory:
        # A "module:function" factory is imported from the spec's folder and may import its neighbours:
        # stamp the Python files there and one level down (bounded: the folder may be a large checkout).
        for py in sorted([*folder.glob("*.py"), *folder.glob("*/*.py")])[:200]:
            files[str(py.relative_to(folder))] = _file_stamp(py)
    if spec.model.hf:
        local = _resolve(spec, spec.model.hf)
        if local is not None and local.is_dir():
            files[f"{spec.model.hf}/config.json"] = _file_stamp(local / "config.json")
    if spec.data.factory and spec.data.path:
        paths = spec.data.path.values() if isinstance(spec.data.path, dict) else [spec.data.path]
        for p in paths:
            resolved = _resolve(spec, p)
            files[str(p)] = _file_stamp(resolved) if resolved else {"missing": True}
    return files


def trace_key(spec: Spec, target: str, ac: bool | str, precision: str, micro_batch: int | None = None,
              seq_len: int | None = None) -> dict:
    """Everything a trace's result depends on, as plain JSON."""
    c = spec.canonical()
    train = c["train"]
    return {
        "format": FORMAT,
        "versions": {"pilotrun": __version__, "torch": _version("torch"), "transformers": _version("transformers")},
        "trace": {"target": target, "activation_checkpointing": ac, "precision": precision,
                  "micro_batch": micro_batch, "seq_len": seq_len},
        "model": c["model"],
        "data": {k: c["data"].get(k) for k in sorted(c["data"]) if k not in ("num_workers", "drop_last")},
        # The learning rate changes no tensor's size: a campaign varying it shares one trace.
        "train": {k: train.get(k) for k in ("micro_batch_size", "grad_accum_steps", "loss_normalization",
                                            "max_grad_norm", "compile")}
                 | {"optimizer": {k: v for k, v in train["optimizer"].items() if k != "lr"}},
        "eval": {k: c["eval"].get(k) for k in ("batch_size", "max_length")},
        "strategy": c["distributed"].get("strategy"),
        "seed": c["seed"],
        "files": _named_files(spec),
    }


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


class CacheStatus(str, Enum):
    HIT = "hit"
    MISSING = "missing"
    UNUSABLE = "unusable"    # a corrupt, truncated or foreign file: traced again and overwritten


@dataclass
class CacheRead:
    status: CacheStatus
    trace: dict | None
    note: str           # what happened, for the user: used, missing, unreadable (and why)
    path: Path


class TraceCache:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def default(cls) -> TraceCache:
        return cls(default_dir())

    def path(self, key: dict) -> Path:
        return self.folder / f"{digest(key)}.json"

    def get(self, key: dict) -> CacheRead:
        path = self.path(key)
        try:
            entry = read_json(path, ENTRY_CAP, ENTRY_SCHEMA)
        except FileProblem as exc:
            if exc.kind == FileKind.MISSING:
                return CacheRead(CacheStatus.MISSING, None, f"no cached trace at {path}", path)
            return CacheRead(CacheStatus.UNUSABLE, None,
                             f"the cached trace {path} is unreadable ({exc.what}): traced again", path)
        problem = _check(entry, key)
        if problem:
            return CacheRead(CacheStatus.UNUSABLE, None,
                             f"the cached trace {path} is unusable ({problem}): traced again", path)
        return CacheRead(CacheStatus.HIT, entry["trace"],
                         f"used the cached trace {path} (traced {entry.get('traced_at', '?')} in "
                         f"{entry['trace'].get('seconds', 0):.1f} s; --no-trace-cache traces again)", path)

    def put(self, key: dict, trace: dict, traced_at: str) -> str | None:
        """Write the entry atomically; a note (not an error) when the cache cannot be written."""
        path = self.path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as f:
                json.dump({"key": key, "traced_at": traced_at, "trace": trace}, f)
            os.replace(f.name, path)
        except OSError as exc:
            return (f"the trace was not cached: {path.parent}: {exc.strerror or exc} (set {CACHE_ENV} to a writable "
                    "folder)")
        return None


# A trace of a 70B model is a few KiB: anything near this is not one (a link to /dev/zero is refused before).
ENTRY_CAP = 8 << 20
_BYTES = NonNegative(integer=True)
_STAGE = {"peak_bytes": _BYTES, "peak_bytes_rounded": _BYTES, "breakdown": MapOf(_BYTES), "tensors": _BYTES,
          "flops": NonNegative(), "seq_len": _BYTES, "batch_size": _BYTES, "optimizer_step_extra_bytes": _BYTES,
          "phases": MapOf([{"bytes": _BYTES, "breakdown": MapOf(_BYTES)}]),
          "ops": Optional([list]), "optimizer_ops": Optional([list]), "attention_ops": Optional([list]),
          "unaligned_matmuls": Optional([list])}
# What the estimate reads of a trace, each number finite and >= 0 (a negative peak printed "-9.1e17 TiB").
ENTRY_SCHEMA = {"key": dict, "trace": {
    "stages": MapOf(_STAGE), "parameters": _BYTES, "trainable_parameters": _BYTES, "parameter_bytes": _BYTES,
    "gradient_bytes": _BYTES, "optimizer_state_bytes": _BYTES, "buffer_bytes": _BYTES,
    "largest_layer_bytes": _BYTES, "largest_layer": str, "layers": _BYTES, "foreach": bool, "precision": str,
    "activation_checkpointing": (bool, str), "seconds": NonNegative(), "grad_accum_steps": _BYTES,
    "max_positions": Optional(_BYTES), "notes": Optional([str]), "optimizer": Optional(str),
    "adaptation": Optional({"quant_state_bytes": Optional(_BYTES), "quantized_bytes": Optional(_BYTES)}),
    "fsdp_parts": {part: {kind: _BYTES for kind in FSDP_PART_KINDS} for part in ("block", "root", "model")}}}


def _check(entry: object, key: dict) -> str | None:
    """Why a parsed entry cannot be used, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("trace"), dict):
        return "not a trace entry"
    if entry.get("key") != key:
        return "its key differs from this job's"
    stages = entry["trace"].get("stages")
    if not isinstance(stages, dict) or not {GateName.FIRST_STEP, GateName.STEADY_STEP, GateName.EVAL} <= set(stages):
        return "stages missing"
    for field in ("parameter_bytes", "optimizer_state_bytes", "precision", "seconds"):
        if field not in entry["trace"]:
            return f"{field} missing"
    for name, stage in stages.items():
        for part in ("ops", "optimizer_ops", "attention_ops"):
            bad = next((r for r in stage.get(part) or [] if not _op_row(r)), None)
            if bad is not None:
                return f"stages.{name}.{part} holds {bad!r}, expected [dtype, flops, bytes, count] (each >= 0)"
        bad = next((r for r in stage.get("unaligned_matmuls") or [] if not _unaligned_row(r)), None)
        if bad is not None:
            return (f"stages.{name}.unaligned_matmuls holds {bad!r}, expected [dtype, M, N, K, flops, count, "
                    "[leading dimensions], [modules]]")
    return None


def _unaligned_row(row: object) -> bool:
    """A row of ops.OpCosts.unaligned_rows: [dtype, M, N, K, flops, count, [odd leading dimensions], [modules]]."""
    return (isinstance(row, list) and len(row) == 8 and isinstance(row[0], str)
            and all(check(v, _BYTES) is None for v in row[1:6])
            and isinstance(row[6], list) and all(check(v, _BYTES) is None for v in row[6])
            and isinstance(row[7], list) and all(isinstance(v, str) for v in row[7]))


def _op_row(row: object) -> bool:
    """[dtype, flops, bytes, count], the time model's input (ops.OpCosts.rows): a negative one would be a negative
    time."""
    return (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
            and all(check(v, _BYTES) is None for v in row[1:]))
