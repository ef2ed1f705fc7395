"""``lock``: record revisions, versions, config and seeds; report drift from the last run of this name."""
from __future__ import annotations

import json

from ..lock import collect_lock, diff_locks, summarize_drift
from .base import Gate, Outcome, Product


class LockGate(Gate):
    name = "lock"
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
        prev = ctx.ledger.previous_lock(ctx.spec.name, ctx.run_id) if ctx.ledger is not None else None
        head = f"recorded lock.json (config {lock['config_hash'][:8]}, torch {lock['versions']['torch']})"
        if prev is None:
            out.reason = f"{head}; first run named {ctx.spec.name!r}, nothing to compare"
        else:
            prev_id, prev_lock = prev
            drift = diff_locks(prev_lock, lock)
            out.details["compared_with"] = prev_id
            out.details["drift"] = [{"field": k, "before": a, "now": b} for k, a, b in drift]
            if drift:
                out.warn(f"drift from {prev_id} in {len(drift)} field(s): {summarize_drift(drift)}")
            else:
                out.reason = f"{head}; no drift from {prev_id}"
            cut = [(k, a, b) for k, a, b in drift if k in ("config.data.max_length", "config.eval.max_length")
                   and isinstance(a, int) and isinstance(b, int) and b < a]
            if cut:
                out.details["different_experiment"] = [{"field": k[7:], "before": a, "now": b} for k, a, b in cut]
                text = "; ".join(f"{k[7:]} was cut from {a} to {b}: outputs change, so this is a different "
                                 f"experiment from {prev_id}, not the same one made to fit" for k, a, b in cut)
                out.warn(text)
                if ctx.ledger is not None and ctx.rank == 0:
                    ctx.ledger.add_note(ctx.run_id, f"different experiment: {text}")
        model = lock["model"]
        if model.get("source") == "hub" and not model.get("pinned"):
            out.warn(f"model.hf {model['id']!r} is not pinned to a commit (model.revision): "
                     "a later run may get other weights")
        if lock["container"].get("inside_container"):
            out.warn("running inside a container whose image digest is unknown: pass --container-digest or set "
                     "$PILOTRUN_CONTAINER_DIGEST")
        if lock["code"].get("dirty"):
            out.warn(f"the git checkout at {lock['code']['commit'][:10]} has uncommitted changes: "
                     "the code is not fully recorded")
        return out


def _short(section: dict) -> dict:
    return {k: v for k, v in section.items() if k not in ("files", "splits")}
