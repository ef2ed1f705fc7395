"""``resume``: a restart continues exactly like an uninterrupted run.

Three fresh processes: a control runs N+K updates; a second runs N, saves and is
killed with SIGKILL; a third restores the checkpoint and runs K more. Update by
update, sample ids, learning rate, loss and gradient norm must match the control's —
bitwise on CPU in fp32, within ``pilot.resume.rtol`` on accelerators and in bf16/fp16.
"""
from __future__ import annotations

import math

from ..drivers import Capability
from ..ledger.records import GateName
from ..train.compile import summed
from ..workers.launch import run_and_kill, run_worker
from .base import Gate, GateFailure, OnProgram, Outcome, Product, on_main_rank

CAUSES = {
    "sample_ids": ("the data order differs: the sampler position or its seed was not restored, so the run replays or "
                   "skips examples"),
    "lr": ("the learning rate differs while the data matches: scheduler state not restored, or rebuilt with "
           "another length"),
    "loss": ("losses differ while ids and lr match: state outside state_dict (a buffer registered with "
             "persistent=False, a Python attribute), or randomness outside the restored generators (an unseeded "
             "random.Random or numpy Generator, DataLoader workers)"),
    "grad_norm": ("gradient norms differ while losses match: state that changes gradients but not the loss was not "
                  "restored (e.g. the grad scaler)"),
}
FIELDS = ("sample_ids", "lr", "loss", "grad_norm")


def _value(x):
    if isinstance(x, str) and x.startswith(("0x", "-0x")):
        return float.fromhex(x)
    if isinstance(x, str):
        return float(x)
    return x


def first_difference(a: list[dict], b: list[dict], exact: bool, rtol: float) -> dict | None:
    """The first update and field where two runs differ, or None."""
    for ra, rb in zip(a, b):
        for f in FIELDS:
            va, vb = ra.get(f), rb.get(f)
            if f == "sample_ids" or exact:
                same = va == vb
            else:
                xa, xb = _value(va), _value(vb)
                same = (xa is None and xb is None) or (
                    xa is not None and xb is not None
                    and (xa == xb or math.isclose(xa, xb, rel_tol=rtol, abs_tol=1e-12)))
            if not same:
                show = (lambda v: v) if f == "sample_ids" else _value
                return {"update": ra["step"], "field": f, "control": show(va), "other": show(vb)}
    return None


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
        by_rank = lambda p, i: (p.get("records_by_rank") or [p["records"]])[i]  # noqa: E731
        before = next((dict(d, rank=i) for i in ranks
                       if (d := first_difference(by_rank(control, i)[: r.before], by_rank(cut, i), exact, r.rtol))),
                      None)
        if before is not None:
            raise GateFailure(
                f"the run is not reproducible even without a restart: at update {before['update']}, {before['field']} "
                f"is {before['control']} in one fresh process and {before['other']} in another — randomness that "
                "the seed does not control (an unseeded generator, nondeterministic kernels)",
                inputs=out.inputs, details=out.details)
        after = next((dict(d, rank=i) for i in ranks
                      if (d := first_difference(by_rank(control, i)[r.before:], by_rank(resumed, i), exact, r.rtol))),
                     None)
        if after is not None:
            raise GateFailure(
                f"after a kill at update {r.before} and a restore, update {after['update']} differs from the "
                f"uninterrupted run in {after['field']}: {after['other']} vs {after['control']}; "
                f"{CAUSES[after['field']]}",
                inputs=out.inputs, details=out.details)
        who = "a fresh process" if n == 1 else f"{n} fresh processes (torchrun)"
        out.reason = (f"killed after update {r.before} (SIGKILL), restored in {who}: updates "
                      f"{r.before + 1}-{r.before + r.after} match the uninterrupted run {rule} in sample ids, lr, loss "
                      "and gradient norm")
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

