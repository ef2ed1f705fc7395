"""``restore``: a fresh process loads the checkpoint; its live state must equal what the saving process held.

The save gate records digests of the live objects — parameters, every buffer (those
registered with ``persistent=False`` too), optimizer tensors and hyper-parameters,
scheduler, grad scaler, every RNG stream, step and data position. A new Python
process (not a fork) builds the job from the spec, loads the checkpoint (hash-verified,
``weights_only=True``) and compares. A mismatch names the field.
"""
from __future__ import annotations

from ..drivers import Capability
from ..workers.launch import run_worker
from .base import Gate, GateFailure, Outcome, Product, on_main_rank


class RestoreGate(Gate):
    name = "restore"
    needs = (Product.CHECKPOINT,)
    requires = (Capability.FULL_STATE, Capability.RESTART)
    job_memory = True
    carry = True

    def track(self, ctx):
        return []

    def run(self, ctx, meter) -> Outcome:
        return on_main_rank(ctx, self, lambda: self._restore(ctx))

    def _restore(self, ctx) -> Outcome:
        work = ctx.worker_dir()
        saved = ctx.checkpoint
        payload = run_worker(
            "pilotrun.workers.train_phase",
            ["--spec", str(ctx.spec_file()), "--phase", "restore", "--checkpoint", str(saved.folder),
             "--expect", str(saved.expect), "--known-manifest", saved.manifest_sha256],
            work / "restore.json", work / "restore.log", "restore", nproc=ctx.world_size)
        out = Outcome(inputs={**ctx.base_inputs(), "checkpoint": str(saved.folder)})
        mem = dict(payload.get("memory") or {})
        mem["measured_in"] = "the restore process"
        out.memory = mem
        out.details = {"mismatches": payload["mismatches"], "restored_step": payload["step"], "lr": payload["lr"],
                       "process_peak": payload.get("peak"), "log": str(work / "restore.log")}
        if payload["mismatches"]:
            first = payload["mismatches"]
            where = (lambda m: f" on rank {m['rank']}") if ctx.world_size > 1 else (lambda m: "")
            shown = "; ".join(f"{m['field']}{where(m)}: {m['hint']}" for m in first[:3])
            more = f" (+{len(first) - 3} more)" if len(first) > 3 else ""
            raise GateFailure(f"a fresh process restored step {payload['step']} but {len(first)} field(s) differ from "
                              f"what was saved: {shown}{more}", inputs=out.inputs, details=out.details)
        who = "a fresh process" if ctx.world_size == 1 else f"{ctx.world_size} fresh processes (torchrun)"
        out.reason = (f"{who} restored step {payload['step']} (lr {payload['lr'][0]:.3g}): parameters, "
                      "buffers, optimizer and scheduler state, RNG streams and data position equal what was saved")
        return out
