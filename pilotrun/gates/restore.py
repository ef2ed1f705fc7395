"""``restore``: a fresh process loads the checkpoint; its live state must equal what the saving process held.

The save gate records digests of the live objects — parameters, every buffer (those
registered with ``persistent=False`` too), optimizer tensors and hyper-parameters,
scheduler, grad scaler, every RNG stream, step and data position. A new Python
process (not a fork) builds the job from the spec, loads the checkpoint (hash-verified,
``weights_only=True``) and compares. A mismatch names the field.

With several processes the strategy says whose buffers are the state (``Strategy.buffer_sync``):
under DDP every rank's restored buffers must equal rank 0's saved copy, which DDP broadcasts at each
forward, not the rank's own copy from its last forward; the reason says which comparison was made.
"""
from __future__ import annotations

from ..drivers import Capability
from ..ledger.records import GateName
from ..workers.launch import run_worker
from .base import Gate, GateFailure, OnProgram, Outcome, Product, on_main_rank


class RestoreGate(Gate):
    name = GateName.RESTORE
    on_program = OnProgram.NEVER
    program_note = ("the program's checkpoint format is its own, so pilotrun cannot read its step, lr "
                    "and RNG back; the resume gate proves the same by continuing from it")
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
             "--expect", str(saved.expect), "--known-manifest", saved.manifest_sha256,
             *(["--expect-sha256", ",".join(saved.expect_sha256)] if saved.expect_sha256 else [])],
            work / "restore.json", work / "restore.log", "restore", nproc=ctx.world_size)
        out = Outcome(inputs={**ctx.base_inputs(), "checkpoint": str(saved.folder)})
        mem = dict(payload.get("memory") or {})
        mem["measured_in"] = "the restore process"
        out.memory = mem
        sync = payload.get("buffer_sync") or {}
        out.details = {"mismatches": payload["mismatches"], "restored_step": payload["step"], "lr": payload["lr"],
                       "buffer_sync": sync or None, "process_peak": payload.get("peak"),
                       "log": str(work / "restore.log")}
        who = "a fresh process" if ctx.world_size == 1 else f"{ctx.world_size} fresh processes (torchrun)"
        if payload["mismatches"]:
            lines = _grouped(payload["mismatches"], ctx.world_size)
            fields = len({m["field"] for m in payload["mismatches"]})
            more = f" (+{len(lines) - 3} more)" if len(lines) > 3 else ""
            # How the strategy holds buffers (why a rank's copy is or is not the state), once for all of them.
            why = "".join(f". {w[0].upper()}{w[1:]}" for w in dict.fromkeys(
                m["strategy"] for m in payload["mismatches"] if m.get("strategy")))
            raise GateFailure(f"{who} restored step {payload['step']} but {fields} field(s) differ from "
                              f"what was saved: {'; '.join(lines[:3])}{more}{why}", inputs=out.inputs,
                              details=out.details)
        buffers = (f"buffers (every rank's equal rank {sync['source_rank']}'s saved copy: {sync['why']})"
                   if sync.get("source_rank") is not None else "buffers")
        out.reason = (f"{who} restored step {payload['step']} (lr {payload['lr'][0]:.3g}): parameters, "
                      f"{buffers}, optimizer and scheduler state, RNG streams and data position equal what was saved")
        return out


def _grouped(mismatches: list[dict], world_size: int) -> list[str]:
    """One line per field and cause, naming every rank it happened on (the same cause on each rank once)."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for m in mismatches:
        ranks.setdefault((m["field"], m["hint"]), []).append(m.get("rank", 0))
    if world_size == 1:
        return [f"{field}: {hint}" for field, hint in ranks]
    out = []
    for (field, hint), where in ranks.items():
        on = f"rank {where[0]}" if len(where) == 1 else f"ranks {', '.join(map(str, where[:-1]))} and {where[-1]}"
        out.append(f"{field} on {on}: {hint}")
    return out
