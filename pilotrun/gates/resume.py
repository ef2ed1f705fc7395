"""``resume``: a restart continues exactly like an uninterrupted run.

Three fresh processes: a control runs N+K updates; a second runs N, saves and is
killed with SIGKILL; a third restores the checkpoint and runs K more. Update by
update, sample ids, loss, learning rate and gradient norm must match the control's —
bitwise on CPU in fp32, within ``pilot.resume.rtol`` on accelerators and in bf16/fp16 —
judged by the comparison programs and integrations use (:mod:`pilotrun.program.compare`):
the same order, causes and tolerances.
"""
from __future__ import annotations

from ..drivers import Capability
from ..ledger.records import GateName
from ..program.compare import (
    ONE_UPDATE,
    Comparison,
    Difference,
    attribute_across_ranks,
    compare_updates,
    first_of,
    loop_updates,
    reproducibility,
)
from ..train.compile import summed
from ..workers.launch import run_and_kill, run_worker
from .base import Gate, GateFailure, OnProgram, Outcome, Product, on_main_rank


def _first_difference(comparisons: dict[int, Comparison]) -> tuple[int, Difference] | None:
    """The rank and difference a failed comparison names (gradients are averaged: a rank's grad_norm difference
    that follows another rank's is pointed at it)."""
    differences = {rank: c.difference for rank, c in comparisons.items() if c.difference is not None}
    attribute_across_ranks(differences)
    return first_of(differences)


class ResumeGate(Gate):
    name = GateName.RESUME
    on_program = OnProgram.RUNS
    program_note = "control, interrupted (SIGKILL after its save) and resumed runs, updates compared"
    needs = (Product.FIRST_UPDATE,)
    requires = (Capability.RESTART, Capability.UPDATES)
    # Its row summarises three processes (the largest host RSS, no allocator peak): not one run's memory.
    job_memory = False
    carry = True

    def track(self, ctx):
        return []

    def describe_inputs(self, ctx) -> dict:
        r = ctx.spec.pilot.resume
        return {**ctx.base_inputs(), "updates_before_kill": r.before, "updates_after_restore": r.after}

    def run(self, ctx, meter) -> Outcome:
        return on_main_rank(ctx, self, lambda: self._resume(ctx))

    def _resume(self, ctx) -> Outcome:
        spec, r = ctx.spec, ctx.spec.pilot.resume
        n = ctx.world_size
        work = ctx.worker_dir()
        ckpts = work / "resume-checkpoints"
        base = ["--spec", str(ctx.spec_file())]
        module = "pilotrun.workers.train_phase"
        ctx.progress(0, 3, "processes")
        control = run_worker(module, base + ["--phase", "control", "--updates", str(r.before + r.after)],
                             work / "control.json", work / "control.log", "control", nproc=n)
        ctx.progress(1, 3, "processes")
        cut = run_and_kill(module, base + ["--phase", "interrupted", "--updates", str(r.before),
                                           "--checkpoints", str(ckpts)],
                           work / "interrupted.json", work / "interrupted.log", "interrupted", nproc=n)
        ctx.progress(2, 3, "processes")
        sha = cut["manifest_sha256"]  # as the interrupted process wrote it, never a re-read of its folder
        resumed = run_worker(module, base + ["--phase", "resumed", "--updates", str(r.after), "--checkpoints",
                                             str(ckpts), "--known-manifest", sha],
                             work / "resumed.json", work / "resumed.log", "resumed", nproc=n)
        ctx.progress(3, 3, "processes")
        exact = ctx.device.type == "cpu" and spec.train.precision == "fp32"
        rule = "bitwise (CPU, fp32)" if exact else f"within rtol {r.rtol:g} ({ctx.device.type}, {spec.train.precision})"
        out = Outcome(inputs=self.describe_inputs(ctx))
        out.details = {"control": control["records"], "interrupted": cut["records"], "resumed": resumed["records"],
                       "checkpoint": cut["checkpoint"], "manifest_sha256": sha, "killed_with": cut.get("killed_with"),
                       "comparison": rule, "logs": str(work)}
        out.memory = {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "device_used_bytes": None,
                      "host_rss_peak_bytes": max(p.get("peak", {}).get("host_rss_peak_bytes", 0)
                                                 for p in (control, cut, resumed)),
                      "measured_in": "the three worker processes (largest)",
                      "not_measured": {"peak_allocated_bytes": "three processes; see the restore row for one restore"}}
        ranks = range(len(control.get("records_by_rank") or [control["records"]]))
        updates = {name: [loop_updates(rank_records) for rank_records in (p.get("records_by_rank") or [p["records"]])]
                   for name, p in (("control", control), ("interrupted", cut), ("resumed", resumed))}
        on = (lambda rank: "") if n == 1 else (lambda rank: f" on rank {rank}")  # noqa: E731
        fresh = _first_difference({i: reproducibility(updates["control"][i], updates["interrupted"][i], r.before,
                                                      exact, r.rtol) for i in ranks})
        if fresh is not None:
            rank, d = fresh
            out.details["difference"] = {**d.to_dict(), "rank": rank}
            raise GateFailure(f"the run is not reproducible even without a restart{on(rank)}: {d.sentence()}",
                              inputs=out.inputs, details=out.details)
        end = r.before + r.after
        compared = {i: compare_updates(updates["control"][i], updates["resumed"][i], r.before + 1, end, exact, r.rtol)
                    for i in ranks}
        out.details["compared_updates"] = compared[0].compared
        out.details["largest_relative_difference"] = max(c.largest_rel for c in compared.values())
        after = _first_difference(compared)
        if after is not None:
            rank, d = after
            out.details["difference"] = {**d.to_dict(), "rank": rank}
            raise GateFailure(f"after a kill at update {r.before} and a restore, the resumed run differs from the "
                              f"uninterrupted one{on(rank)} at {d.sentence()}", inputs=out.inputs, details=out.details)
        who = "a fresh process" if n == 1 else f"{n} fresh processes (torchrun)"
        out.reason = (f"killed after update {r.before} (SIGKILL), restored in {who}: updates "
                      f"{r.before + 1}-{r.before + r.after} match the uninterrupted run {rule} in sample ids, loss, lr "
                      "and gradient norm")
        if r.after < 2:
            out.warn(f"{out.reason}; {ONE_UPDATE}")
        _resume_compile(out, control["records"], resumed["records"])
        return out


def _resume_compile(out: Outcome, control: list[dict], resumed: list[dict]) -> None:
    """train.compile: the resumed process is fresh and compiles again; its compile seconds (and the control's, for
    scale) in the row: each restart after a preemption pays them once."""
    again, first = summed(resumed), summed(control)
    if again is None:
        return
    out.details["compile"] = {"resumed": again.to_dict(), "control": first.to_dict() if first else None}
    out.reason = (f"{out.reason}; the resumed process compiled again: {again.seconds:.1f} s, {again.graphs} graph(s) "
                  "(paid at every restart)")

