"""The full training state on disk: model, optimizer, scheduler, scaler, every RNG, data position.

Everything loads with ``torch.load(weights_only=True)`` or from JSON: RNG states
are tensors or lists of ints, the scheduler is its ``state_dict`` (plain numbers),
nothing is pickled.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

from ..devices import query_devices
from ..safefile import FileKind, FileProblem, parse_json, read_bytes
from .io import CheckpointError, read_manifest
from .pinned import pinned
from .statefiles import STATE_JSON_CAP, check_config, check_trainer_state, job_hash


def capture_rng() -> tuple[dict, dict]:
    """(JSON part, tensor part) of every RNG stream: python, numpy, torch CPU, each accelerator."""
    version, state, gauss = random.getstate()
    js: dict = {"python": {"version": version, "state": list(state), "gauss": gauss}}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        js["numpy"] = {"name": name, "keys": np.asarray(keys).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    # The host's generator is every process's; the accelerator's streams are its backend's ("cuda_<i>" on CUDA
    # and ROCm), under the keys every checkpoint so far has.
    tensors = {"torch_cpu": torch.get_rng_state(), **query_devices().runtime.rng_state()}
    return js, tensors


def restore_rng(js: dict, tensors: dict) -> None:
    py = js["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "numpy" in js:
        import numpy as np

        n = js["numpy"]
        np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    query_devices().runtime.set_rng_state(tensors)  # another runtime's streams (a GPU's, on a CPU) stay unused


def save_to(payload: dict, path: Path) -> None:
    """``torch.save`` through a Python file: given a path, torch's C++ writer loses the OS error, and a full disk
    reads "unexpected pos 768 vs 662"; through a file the OSError (ENOSPC) is chained to torch's error, and the
    save row says "No space left on device" (gates/save.write_failure)."""
    with open(path, "wb") as fh:
        torch.save(payload, fh)


def _load_sharded(folder: Path, prefix: str, reference: dict | None = None) -> tuple[dict, dict]:
    """The shards the manifest lists (a stray file matching the pattern is never read); with ``reference``
    (the live state_dict) every entry's name, shape and dtype is checked, naming the shard that differs."""
    import re

    pattern = re.compile(rf"{re.escape(prefix)}-(\d{{5}})-of-(\d{{5}})\.pt")
    names = sorted(n for n in read_manifest(folder)["files"] if pattern.fullmatch(n))
    if not names:
        raise CheckpointError(f"{folder} has no {prefix} shards ({prefix}-00000-of-N.pt) in its manifest")
    expected = int(pattern.fullmatch(names[0]).group(2))  # type: ignore[union-attr]
    if len(names) != expected:
        raise CheckpointError(f"{folder} lists {len(names)} of {expected} {prefix} shards")
    entries: dict = {}
    extra: dict = {}
    where: dict = {}
    for i, name in enumerate(names):
        path = Path(folder) / name
        payload = load_torch_file(path)
        if not isinstance(payload, dict) or not isinstance(payload.get("entries"), dict):
            raise CheckpointError(f"{path}: field 'entries' is missing: not a pilotrun {prefix} shard")
        for key, value in payload.pop("entries").items():
            entries[key] = value
            where[key] = path
        if i == 0:
            extra = payload
    if reference is not None:
        _check_tensors(folder, prefix, entries, where, reference)
    return entries, extra


def _check_tensors(folder: Path, prefix: str, entries: dict, where: dict, reference: dict) -> None:
    missing = [k for k in reference if k not in entries]
    if missing:
        raise CheckpointError(f"{folder}: the {prefix} shards lack {missing[:3]} (the model has them)")
    extra = [k for k in entries if k not in reference]
    if extra:
        raise CheckpointError(f"{where[extra[0]]}: entry {extra[0]!r} is not in the model")
    for key, ref in reference.items():
        got = entries[key]
        if isinstance(ref, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.shape != ref.shape
                                              or got.dtype != ref.dtype):
            what = (f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__)
            raise CheckpointError(f"{where[key]}: entry {key!r} is {what}, the model's is "
                                  f"{tuple(ref.shape)} {ref.dtype}")


def model_state(trainer) -> dict:
    """What a checkpoint holds of the model: its state_dict, or with an adapter (``trainer.base_identity`` set) the
    trainable parameters alone — the frozen base is rebuilt from the spec and checked by its identity instead."""
    if getattr(trainer, "base_identity", None) is None:
        return trainer.model.state_dict()
    return {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}


# -- loading -----------------------------------------------------------------------------

def load_torch_file(path: Path):
    """``torch.load(weights_only=True)`` with errors that name the file instead of a deep torch trace."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # corrupted zip, truncated file, or a pickled object that weights_only refuses
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} cannot be loaded safely (weights_only=True): {first}") from None


def load_json(path: Path, sha256: str | None = None) -> dict:
    """A regular file (never a link, device or FIFO) of at most STATE_JSON_CAP bytes, holding a JSON object; with
    ``sha256`` (a file outside the manifest whose digest the save recorded) only if its bytes hash to it."""
    try:
        raw = read_bytes(path, STATE_JSON_CAP)
        if sha256 is not None and (got := hashlib.sha256(raw).hexdigest()) != sha256:
            raise CheckpointError(f"{path} is not the file the save wrote (sha256 {got[:12]}…, the save recorded "
                                  f"{sha256[:12]}…): it was changed after the save; not compared")
        return parse_json(raw, Path(path), dict)
    except FileProblem as exc:
        if exc.kind == FileKind.MISSING:
            raise CheckpointError(f"{path} is missing") from None
        raise CheckpointError(f"{exc}: not the state file that was saved") from None


def conform(path: Path, loaded, reference, where: str = "") -> None:
    """``loaded`` (read from ``path``) has the structure of ``reference`` (the live object's own state):
    the same keys, list lengths and value types, recursively; the first difference names the file and field.
    Values may differ — that is what a restore sets — but a missing key or a string for a number would
    otherwise surface as a bare KeyError or TypeError deep inside torch."""
    at = where or "(top level)"
    if isinstance(reference, dict):
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path}: field {at} is {type(loaded).__name__}, expected a mapping")
        for key in reference:
            if str(key) not in {str(k) for k in loaded}:
                raise CheckpointError(f"{path}: field {where + '.' if where else ''}{key} is missing")
        for key in loaded:
            if str(key) not in {str(k) for k in reference}:
                raise CheckpointError(f"{path}: field {where + '.' if where else ''}{key} is not expected here")
        by_str = {str(k): v for k, v in loaded.items()}
        for key, ref in reference.items():
            conform(path, by_str[str(key)], ref, f"{where + '.' if where else ''}{key}")
    elif isinstance(reference, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(reference):
            got = f"{len(loaded)} items" if isinstance(loaded, (list, tuple)) else type(loaded).__name__
            raise CheckpointError(f"{path}: field {at} is {got}, expected a list of {len(reference)}")
        for i, (lv, rv) in enumerate(zip(loaded, reference)):
            conform(path, lv, rv, f"{where}[{i}]")
    elif isinstance(reference, bool) or reference is None:
        if not (loaded is None or isinstance(loaded, type(reference)) or reference is None):
            raise CheckpointError(f"{path}: field {at} is {loaded!r}, expected {type(reference).__name__}")
    elif isinstance(reference, (int, float)):
        if isinstance(loaded, bool) or not isinstance(loaded, (int, float)):
            raise CheckpointError(f"{path}: field {at} is {loaded!r}, expected a number")
    elif isinstance(reference, str) and not isinstance(loaded, str):
        raise CheckpointError(f"{path}: field {at} is {loaded!r}, expected a string")


def load_state_json(path: Path, reference, sha256: str | None = None) -> dict:
    """A JSON state file (whose bytes hash to ``sha256`` when given) checked against the live object's own state
    (:func:`conform`)."""
    loaded = load_json(path, sha256)
    conform(path, loaded, json.loads(json.dumps(reference, default=str)))
    return loaded


# Optimizer state entries shaped like their parameter (torch AdamW/SGD, bitsandbytes' state1/state2).
PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2"})


def restore_training_state(trainer, folder: Path) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into a freshly built trainer (admitted by the policy
    first), every file read from a :func:`~pilotrun.checkpoint.pinned.pinned` view of it: the files checked are the
    files loaded. Every file is checked against the live objects' own state before it is applied, so a wrong file is
    named with its field instead of failing inside torch."""
    with pinned(folder) as view:
        return _restore_from(trainer, view.folder)


def _restore_from(trainer, folder: Path) -> dict:
    base = getattr(trainer, "base_identity", None)
    saved_base = read_manifest(folder).get("base_identity")
    if base != saved_base:
        if base is None or saved_base is None:
            raise CheckpointError(f"{folder} holds {'an adapter alone' if saved_base else 'a full model'} but this job "
                                  f"{'trains a full model' if base is None else 'trains an adapter'}: it was written "
                                  "for another model.adapter setting")
        raise CheckpointError(f"{folder}: its adapter was trained on another base (sha256 {saved_base[:12]}…), this "
                              f"job's base is {base[:12]}…: the same model, revision, seed and quantization are needed")
    check_config(folder, job_hash(trainer))  # after the base: another base is the more precise reason
    weights, _ = _load_sharded(folder, "model", model_state(trainer))
    if base is None:
        trainer.model.load_state_dict(weights)
    else:
        with torch.no_grad():  # the adapter's parameters, in place (the base stays as built)
            live = dict(trainer.model.named_parameters())
            for name, value in weights.items():
                live[name].copy_(value)
    opt_file = folder / min(n for n in read_manifest(folder)["files"] if n.startswith("optimizer-"))
    opt_state, opt_extra = _load_sharded(folder, "optimizer")
    live = trainer.optimizer.state_dict()
    if "param_groups" not in opt_extra:
        raise CheckpointError(f"{folder}: the first optimizer shard lacks field 'param_groups'")
    conform(opt_file, json.loads(json.dumps(opt_extra["param_groups"], default=str)),
            json.loads(json.dumps(live["param_groups"], default=str)), "param_groups")
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for idx, st in opt_state.items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(st, dict):
            raise CheckpointError(f"{folder}: optimizer state entry {idx!r} names no parameter of this model")
        for k, v in st.items():
            # Only the moments shaped like their parameter: bitsandbytes' quantisation maps and block maxima and
            # Adafactor's factored row/column statistics have shapes of their own.
            if k in PARAM_SHAPED and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != params[idx].shape:
                raise CheckpointError(f"{folder}: optimizer state {idx}.{k} is {tuple(v.shape)}, its parameter "
                                      f"{tuple(params[idx].shape)}")
    try:
        trainer.optimizer.load_state_dict({"state": opt_state, "param_groups": opt_extra["param_groups"]})
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{folder}: the optimizer shards do not load ({type(exc).__name__}: {exc})") from None
    trainer.scheduler.load_state_dict(load_state_json(folder / "scheduler.json", trainer.scheduler.state_dict()))
    if trainer.scaler is not None:
        if not (folder / "scaler.json").exists():
            raise CheckpointError(f"{folder} has no scaler.json but the run uses fp16 with a grad scaler")
        trainer.scaler.load_state_dict(load_state_json(folder / "scaler.json", trainer.scaler.state_dict()))
    rng_json, rng_tensors = capture_rng()
    rng_t = load_torch_file(folder / "rng.pt")
    if not isinstance(rng_t, dict) or not isinstance(rng_t.get("torch_cpu"), torch.Tensor) \
            or rng_t["torch_cpu"].shape != rng_tensors["torch_cpu"].shape:
        raise CheckpointError(f"{folder / 'rng.pt'}: field 'torch_cpu' is not a CPU generator state")
    restore_rng(load_state_json(folder / "rng.json", rng_json), rng_t)
    state = load_state_json(folder / "trainer_state.json", trainer.state())
    check_trainer_state(folder / "trainer_state.json", state, read_manifest(folder))
    trainer.load_state(state)
    return state


# -- fingerprints: what a restore must reproduce --------------------------------------------

def _digest(t: torch.Tensor) -> str:
    t = t.detach()
    if hasattr(t, "to_local"):  # an FSDP2 shard: this rank's part
        t = t.to_local()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    data = flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:32] + f":{tuple(t.shape)}:{str(t.dtype)[6:]}"


def _json_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _flat(state: dict, prefix: str = ""):
    """(key, value) pairs of one parameter's optimizer state, nested mappings flattened with dots (bitsandbytes
    keeps its quantisation state under ``__bnb_optimizer_quant_state__``): every tensor gets its own digest."""
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def fingerprint_state(trainer, buffer_sync=None, env=None) -> dict:
    """Digests of everything a resumed run depends on, taken from the live objects (not from disk).

    With several processes (``env.active``), ``buffer_sync`` (a strategy's ``BufferSync``) is recorded
    with the digests: when one rank's buffers are the state (DDP), that rank's buffer digests are what
    every rank's restore must reproduce. Every rank calls it then (the digests are gathered)."""
    model = trainer.model
    persistent = set(model.state_dict().keys())
    rng_json, rng_tensors = capture_rng()
    opt_state = trainer.optimizer.state_dict()
    fp: dict = {
        "step": trainer.step,
        "examples_seen": trainer.examples_seen,
        "data_position": trainer.position(),
        "lr": [float(x) for x in trainer.scheduler.get_last_lr()],
        "scheduler": _json_digest({k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}),
        "rng.python": _json_digest(rng_json["python"]),
        "rng.numpy": _json_digest(rng_json.get("numpy")),
        **{f"rng.{k}": _digest(v) for k, v in rng_tensors.items()},
        # With an adapter the frozen base counts by its identity as built (bitsandbytes repacks 4-bit weights in
        # place on their first CPU forward, so their bytes are not a state); the adapter's parameters by digest.
        "parameters": {n: _digest(p) for n, p in model.named_parameters()
                       if getattr(trainer, "base_identity", None) is None or p.requires_grad},
        **({"base": trainer.base_identity} if getattr(trainer, "base_identity", None) is not None else {}),
        "buffers": {n: {"digest": _digest(b), "persistent": n in persistent} for n, b in model.named_buffers()},
        "optimizer.hyperparameters": _json_digest(opt_state["param_groups"]),
        "optimizer.state": {f"{i}.{k}": (_digest(v) if isinstance(v, torch.Tensor) else repr(v))
                            for i, st in opt_state["state"].items() for k, v in _flat(st)},
    }
    if trainer.scaler is not None:
        fp["scaler"] = _json_digest(trainer.scaler.state_dict())
    if env is not None and env.active and buffer_sync is not None:
        from .. import distributed

        own = {name: b["digest"] for name, b in fp["buffers"].items()}
        source = buffer_sync.source_rank
        every = distributed.gather(env, own)  # every rank calls gather, whether or not a source rank exists
        fp["buffer_sync"] = {"source_rank": source, "why": buffer_sync.why,
                             "source_digests": every[source] if source is not None else None}
    return fp


HINTS = {
    "lr": ("the learning rate changed across the restore: the scheduler state was not restored, or it was rebuilt "
           "with another length"),
    "scheduler": "the scheduler state was not restored",
    "scaler": "the fp16 grad scaler state (scale, growth tracker) was not restored",
    "data_position": "the data position was not restored: the next batches would replay or skip examples",
    "step": "the update counter was not restored",
    "examples_seen": "the examples-seen counter was not restored",
    "optimizer": "optimizer state (moments, step counts or hyper-parameters) was not restored",
    "rng": "a random generator was not restored: dropout masks and augmentation would differ",
    "parameters": "a parameter differs: the weights were not restored",
    "base": "the frozen base differs from the one the adapter was trained on",
}


def _buffer_mismatches(saved: dict, restored: dict, sync: dict | None) -> list[dict]:
    """Buffers whose restored digest is not the saved one: this rank's own, or the source rank's where the
    strategy makes one rank's buffers the state (``sync``, recorded at save)."""
    source = (sync or {}).get("source_digests") or {}
    why = (sync or {}).get("why") or ""
    out = []
    for name, info in saved.items():
        got = restored.get(name)
        want = source.get(name, info["digest"])
        if got is not None and got["digest"] == want:
            continue
        if not info["persistent"]:  # the cause whatever the strategy: the checkpoint never held it
            hint = ("it is registered with persistent=False, so state_dict() does not save it: register it as "
                    "persistent, or recompute it on load")
        elif source:
            hint = (f"the buffer was not restored to rank {(sync or {}).get('source_rank')}'s saved copy, which "
                    "every rank must hold")
        else:
            hint = "the buffer was not restored"
        mismatch = {"field": f"buffer {name!r}", "hint": hint}
        if why and info["persistent"]:
            mismatch["strategy"] = why  # the same for every buffer: the gate says it once
        out.append(mismatch)
    return out


def compare_fingerprints(expected: dict, actual: dict) -> list[dict]:
    """Each field that differs, with the name of the tensor or stream and what usually causes it."""
    out = []
    for key in expected:
        a, b = expected[key], actual.get(key)
        if key == "buffer_sync":
            continue  # how the buffers below are compared, not state
        if key == "buffers":
            out.extend(_buffer_mismatches(a, (b or {}), expected.get("buffer_sync")))
            continue
        if isinstance(a, dict) and key in ("parameters", "optimizer.state"):
            for name, digest in a.items():
                if (b or {}).get(name) != digest:
                    out.append({"field": f"{key.split('.')[0]} {name!r}",
                                "hint": HINTS["parameters" if key == "parameters" else "optimizer"]})
            extra = sorted(set(b or {}) - set(a))
            if extra:
                out.append({"field": f"{key} has unexpected entries {extra[:3]}", "hint": HINTS["optimizer"]})
            continue
        if a != b:
            family = key.split(".")[0]
            mismatch: dict[str, Any] = {"field": key, "saved": a if not isinstance(a, str) else a[:16],
                                        "restored": b if not isinstance(b, str) else (b or "")[:16],
                                        "hint": HINTS.get(key, HINTS.get(family, "differs after restore"))}
            out.append(mismatch)
    return out
