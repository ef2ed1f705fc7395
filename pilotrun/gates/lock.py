"""``lock``: record revisions, versions, config and seeds; report drift from the last run of this name.

Four kinds of difference from the last run (or the proven lock a task carried) are kept apart
(:class:`pilotrun.lock.DriftKind`): a config key the user changed is the experiment they meant to run, an edit of the
program's files, a factory's module or the git commit is code, and the same releases built for another device (the
rented node's CUDA build of a laptop's CPU torch) are the device — all three said as information — while other
versions, another container or other model/data content under the same config is the environment drifting (a
warning)."""
from __future__ import annotations

import json

from ..ledger.records import GateName
from ..lock import (
    DriftKind,
    classify_drift,
    collect_lock,
    config_changes,
    diff_locks,
    summarize_code,
    summarize_drift,
)
from .base import Gate, OnProgram, Outcome, Product

# Cutting a length changes the expected outputs (docs/guides/fix-memory.md, "Same or different experiment"): a
# different experiment, said as a warning.
LENGTH_KEYS = ("data.max_length", "eval.max_length")


class LockGate(Gate):
    name = GateName.LOCK
    on_program = OnProgram.PILOT
    program_note = "pilotrun hashes the program's files and records its command"
    produces = (Product.LOCK,)

    def track(self, ctx):
        return []

    def describe_inputs(self, ctx) -> dict:
        return {"rank": ctx.rank, "world_size": ctx.world_size}

    def run(self, ctx, meter) -> Outcome:
        cache_path = ctx.out_dir.parent / ".hash-cache.json"
        try:
            cache = json.loads(cache_path.read_text())
        except (OSError, ValueError):
            cache = {}
        lock = collect_lock(ctx.spec, ctx.container_digest, cache)
        try:
            cache_path.write_text(json.dumps(cache))
        except OSError:
            pass
        path = ctx.out_dir / "lock.json"
        ctx.lock = lock
        if ctx.rank == 0:  # one lock per run; every rank compares its own environment with the last run's
            path.write_text(json.dumps(lock, indent=1, sort_keys=True))
            if ctx.ledger is not None:
                ctx.ledger.set_lock(ctx.run_id, lock)
        out = Outcome(inputs=self.describe_inputs(ctx))
        out.details = {"lock_path": str(path), "config_hash": lock["config_hash"],
                       "versions": lock["versions"], "model": _short(lock["model"]), "data": _short(lock["data"])}
        warnings: list[str] = []
        info = [f"recorded lock.json (config {lock['config_hash'][:8]}, torch {lock['versions']['torch']})"]
        # The proven environment (a lock.json a task carried to the node) when given, else this name's last run.
        prev = ctx.proven_lock or (ctx.ledger.previous_lock(ctx.spec.name, ctx.run_id) if ctx.ledger is not None
                                   else None)
        if prev is None:
            info.append(f"first run named {ctx.spec.name!r}, nothing to compare")
        else:
            prev_id, prev_lock = prev
            kinds = classify_drift(diff_locks(prev_lock, lock))
            environment, changes = kinds[DriftKind.ENVIRONMENT], config_changes(kinds[DriftKind.EXPERIMENT])
            device = kinds[DriftKind.DEVICE]
            out.details["compared_with"] = prev_id
            out.details["drift"] = [{"field": k, "before": a, "now": b, "kind": str(kind)}
                                    for kind, items in kinds.items() for k, a, b in items]
            out.details["config_changes"] = [{"key": k, "before": a, "now": b} for k, a, b in changes]
            if environment:
                warnings.append(f"the environment drifted from {prev_id} in {len(environment)} field(s): "
                                f"{summarize_drift(environment)}")
            cut = [(k, a, b) for k, a, b in changes if k in LENGTH_KEYS
                   and isinstance(a, int) and isinstance(b, int) and b < a]
            changed_on_purpose = [c for c in changes if c not in cut]
            if changed_on_purpose:
                info.append(f"config changed from {prev_id}: {summarize_drift(changed_on_purpose, sep=' ')}")
            code = kinds[DriftKind.CODE]
            if code:
                out.details["code_changes"] = [{"field": k, "before": a, "now": b} for k, a, b in code]
                info.append(f"code changed from {prev_id}: {summarize_code(code)}")
            if device:
                info.append(f"built for another device than {prev_id} in {len(device)} field(s) (expected on "
                            f"another accelerator): {summarize_drift(device, limit=3)}")
            if not environment and not changes and not code and not device:
                info.append(f"no drift from {prev_id}")
            elif not environment:
                info.append("no environment drift")
            if cut:
                out.details["different_experiment"] = [{"field": k, "before": a, "now": b} for k, a, b in cut]
                text = "; ".join(f"{k} was cut from {a} to {b}: outputs change, so this is a different "
                                 f"experiment from {prev_id}, not the same one made to fit" for k, a, b in cut)
                warnings.append(text)
                if ctx.ledger is not None and ctx.rank == 0:
                    ctx.ledger.add_note(ctx.run_id, f"different experiment: {text}")
        model = lock["model"]
        if model.get("source") == "hub" and not model.get("pinned"):
            warnings.append(f"model.hf {model['id']!r} is not pinned to a commit (model.revision): "
                            "a later run may get other weights")
        info.append(_container_text(lock["container"]))
        if lock["code"].get("dirty"):
            warnings.append(f"the git checkout at {lock['code']['commit'][:10]} has uncommitted changes: "
                            "the code is not fully recorded")
        if "program" in lock:  # the lock records the program's command and files (lock.program_lock)
            program = lock["program"]
            out.details["program"] = program
            info.append(f"program: {len(program.get('files', {}))} file(s) hashed ({program.get('files_from')}), "
                        "command recorded")
        for text in warnings:
            out.warn(text)
        out.reason = "; ".join(([out.reason] if out.reason else []) + info)
        return out


def _container_text(container: dict) -> str:
    """Where the image digest came from, or why there is none: information, never a warning (most pilots run on a
    plain machine, and inside a container the digest is often not visible from within)."""
    if container.get("digest"):
        return f"container {container['digest']} (from {container['from']})"
    if container.get("inside_container"):
        return ("container digest not known: this runs inside a container that does not expose its image digest; "
                "pass --container-digest sha256:... (or set $PILOTRUN_CONTAINER_DIGEST) to record it")
    return "not in a container: no image digest to record"


def _short(section: dict) -> dict:
    return {k: v for k, v in section.items() if k not in ("files", "splits")}
