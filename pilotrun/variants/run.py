"""Run the control and its variants side by side in one process, measure them, and write their rows.

Every configuration is built from the spec (the control's with the variant's keys set), its model loaded with the
control's initial weights (cast to its dtype), and all of them run the same updates on the same examples:
update by update, in a rotating order (a round), each update seeded alike so dropout draws the same masks. The
first two updates of each are measured with the live-tensor tracker over its own model, optimizer and update
(the allocator's counters would also hold the other configurations' state, which this process keeps alive); the
rest are timed only, so the time ratio is taken round by round on a machine whose speed drifts. Then each is
validated, judged against the control (:mod:`.judge`) and written to the ledger as one ``variant`` row per
configuration, the variants' rows linked to the control's.

Example::

    result = run_variants("examples/tiny-sft/pilot.yaml", ledger_path=Path("runs/ledger.sqlite"))
    [(a.name, a.row.verdict if a.row else None) for a in result.arms]
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import strategies
from ..config.load import load_spec
from ..config.schema import SpecError
from ..config.spec import Spec
from ..drivers import build_driver, driver_class, join_job, load_inputs
from ..drivers.base import NonFiniteError
from ..drivers.loop import LoopDriver
from ..humanize import human_bytes
from ..ledger.details import VariantDetails
from ..ledger.records import VARIANT_ROW, GateRow, RunKind, RunStatus, Verdict, new_run_id
from ..ledger.store import Ledger
from ..measure.meter import is_oom, out_of_memory_reason, synchronize
from ..measure.tensors import LiveTensorTracker
from ..models.loading import ModelError
from ..train.fp8 import Fp8Record, fp8_problems
from ..train.rng import derived_seed, seed_everything
from .define import Kind, Skipped, Variant, compare_specs, plan_variants
from .judge import UpdatePoint, compare_updates, judge, rel_diff, time_ratio

MEASURED = 2  # updates per configuration measured for memory; the rest are timed


@dataclass
class Arm:
    """One configuration: the control (``variant`` None) or a variant."""

    name: str
    spec: Spec
    variant: Variant | None = None
    driver: LoopDriver | None = None
    points: list[UpdatePoint] = field(default_factory=list)
    peak: int | None = None
    error: str | None = None
    val: float | None = None
    same_init: bool | None = None
    scaler_calls: int = 0
    row: GateRow | None = None  # its row, once compared (the ledger keeps its JSON form)
    # Why it was not compared, when that is not the variant's own failure: a policy the model cannot take, or out
    # of memory while the other configurations were resident in this process (then a SKIP row, not a FAIL).
    not_compared: str | None = None
    fp8: Fp8Record | None = None  # train.precision fp8: the Linears its build converted (train/fp8.py)

    @property
    def live(self) -> bool:
        return self.driver is not None and self.error is None


@dataclass
class VariantsResult:
    run_id: str
    arms: list[Arm]
    skipped: list[Skipped]
    updates: int
    rtol: float
    device: str


def _load(path: str | Path, overrides: list[str], extra: list[str], variant: str | None) -> Spec:
    try:
        spec = load_spec(path, overrides + extra)
    except SpecError as exc:
        if variant is None:
            raise
        raise SpecError([(f"pilot.variants ({variant})" + (f": {f}" if f else ""), m) for f, m in exc.problems],
                        exc.source) from None
    if not driver_class(spec).in_process:  # the variants are built and compared in this process
        raise SpecError([("program", "pilotrun variants runs pilotrun's own loop (model/data/train); a program's "
                                     "variants are not run yet: pilot the program, and vary its flags by hand")],
                        spec.source)
    if strategies.get(spec.distributed.strategy).multi_process:
        one = strategies.one_process().name
        raise SpecError([("distributed.strategy", f"variants run side by side in one process: set "
                                                  f"distributed.strategy: {one} (--set distributed.strategy={one})")],
                        spec.source)
    return spec


def _count_scaler_updates(arm: Arm) -> None:
    """Count GradScaler.update calls: the scale must move once per optimizer update, never per micro batch."""
    scaler = getattr(arm.driver, "scaler", None)
    if scaler is None:
        return
    real = scaler.update

    def counted(*args, **kwargs):
        arm.scaler_calls += 1
        return real(*args, **kwargs)

    scaler.update = counted


def _same_weights(arm: Arm, initial: dict) -> bool:
    """Load the control's initial weights into the arm's model (cast to its dtypes and device); False where the
    state dicts do not match (another architecture, or an adapter): the arm then keeps its own seeded
    initialisation."""
    assert arm.driver is not None
    model = arm.driver.plain_model
    own = model.state_dict()
    if set(own) != set(initial) or any(own[k].shape != initial[k].shape for k in own):
        return False
    model.load_state_dict(initial)
    return True


def _fail(arm: Arm, exc: BaseException, device: torch.device, step: int, beside: int = 0) -> None:
    """Record why ``arm`` stopped, and free what it holds: the others go on without its memory. ``beside``: the
    other configurations resident in this process when it ran out of memory (then it is not compared: alone it
    might fit)."""
    if isinstance(exc, NonFiniteError):
        arm.error = str(exc)
    elif is_oom(exc):
        arm.error = f"update {step}: {out_of_memory_reason(exc, device) or 'out of memory'}"
        if beside:
            arm.not_compared = (f"out of memory beside {beside} other configuration(s) held in this process; "
                                "run it alone (pilot.variants.run: [its name]) to measure it")
    elif isinstance(exc, ModelError) and exc.field == "train.activation_checkpointing":
        arm.error = str(exc)
        arm.not_compared = f"not run: {exc}"
    else:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        arm.error = f"update {step}: {type(exc).__name__}: {first}"
    _release(arm)


def _release(arm: Arm) -> None:
    if arm.driver is not None:
        arm.driver.close()
        arm.driver = None
    gc.collect()


def _one_update(arm: Arm, step: int, seed: int, pad: int | None, device: torch.device, beside: int) -> None:
    seed_everything(derived_seed(seed * 1_000_003 + step))  # the same dropout masks for every configuration
    calls = arm.scaler_calls
    d = arm.driver
    assert d is not None
    try:
        synchronize(device)  # the previous configuration's queued work is not this one's time
        t0 = time.perf_counter()
        if step <= MEASURED:
            with LiveTensorTracker(track=[d.model, d.optimizer], device_type=device.type) as tracker:
                rec = d.update(pad_to=pad)
            arm.peak = max(arm.peak or 0, tracker.peak_bytes)
        else:
            rec = d.update(pad_to=pad)
        synchronize(device)
        seconds = time.perf_counter() - t0
    except Exception as exc:
        _fail(arm, exc, device, step, beside=beside)
        return
    arm.points.append(UpdatePoint(rec.step, rec.loss, rec.grad_norm, seconds, list(rec.sample_ids),
                                  bool(rec.scaler_skipped), arm.scaler_calls - calls if d.scaler else None))


def _build(arms: list[Arm], control_inputs, process, on_progress) -> None:
    control = arms[0]
    initial: dict = {}
    for arm in arms:
        on_progress(f"building {arm.name}")
        try:
            same_data = arm.spec.canonical()["data"] == control.spec.canonical()["data"]
            inputs = control_inputs if same_data else load_inputs(arm.spec)
            driver = build_driver(arm.spec, inputs, process)
            if not isinstance(driver, LoopDriver):  # _load refused program specs: only the loop is built here
                raise TypeError(f"expected pilotrun's loop, got the {driver.name} driver")
            arm.driver = driver
            arm.fp8 = driver.fp8
            if arm is control:  # kept on the host: the device holds the configurations, not a spare copy
                initial = {k: v.detach().to("cpu", copy=True) for k, v in driver.plain_model.state_dict().items()}
            else:
                arm.same_init = _same_weights(arm, initial)
        except Exception as exc:
            _fail(arm, exc, process.device, 0, beside=sum(1 for a in arms if a.live and a is not arm))
            arm.error = "building it: " + (arm.error or "").removeprefix("update 0: ")
            continue
        _count_scaler_updates(arm)


def _pad(spec: Spec, driver: LoopDriver | None) -> int | None:
    """The length updates are padded to, as the pilot's steady_step pads them (built-in tasks; None: the user's
    collate decides)."""
    return spec.data.max_length if driver is not None and driver.pad_batch is not None else None


def run_variants(path: str | Path, overrides: list[str] | None = None, ledger_path: Path | None = None,
                 on_progress: Callable[[str], None] = lambda _: None) -> VariantsResult:
    """The control and each variant of ``pilot.variants``, run, measured, judged and written (see the module)."""
    overrides = list(overrides or [])
    control_spec = _load(path, overrides, [], None)
    planned = plan_variants(control_spec)
    arms = [Arm("control", control_spec)]
    for v in planned.run:
        arms.append(Arm(v.name, _load(path, overrides, v.overrides, v.name), variant=v))
    cfg = control_spec.pilot.variants
    process = join_job(control_spec)
    if process.env.active:
        raise SpecError([("distributed.strategy", "variants run in one process: start pilotrun variants without "
                                                  "torchrun")], control_spec.source)
    _check_fp8(arms, process.device)
    inputs = load_inputs(control_spec)
    val_start = None
    try:
        _build(arms, inputs, process, on_progress)
        control = arms[0]
        if control.live and control.driver is not None:
            on_progress("validating the initial weights")
            seed_everything(control_spec.seed)
            val_start = float(control.driver.evaluate()["val_loss"])
            _rounds(arms, cfg.updates, control_spec.seed, process.device, on_progress)
        for arm in arms:
            if arm.live and arm.driver is not None:
                on_progress(f"validating {arm.name}")
                seed_everything(control_spec.seed)
                try:
                    arm.val = float(arm.driver.evaluate()["val_loss"])
                except Exception as exc:
                    _fail(arm, exc, process.device, cfg.updates)
    finally:
        for arm in arms:
            _release(arm)
    run_id = _write(arms, control_spec, cfg, planned.skipped, ledger_path, process, val_start)
    return VariantsResult(run_id, arms, planned.skipped, cfg.updates, cfg.val_loss_rtol, str(process.device))


def _check_fp8(arms: list[Arm], device: torch.device) -> None:
    """An fp8 configuration on a device without float8 matmuls, or without torchao: exit 2 before anything runs."""
    problems = [(f"pilot.variants ({arm.name}): {field}", message) for arm in arms
                for field, message in fp8_problems(arm.spec.train.precision, device, arm.spec.model.adapter,
                                                   arm.spec.model.quantization)]
    if problems:
        raise SpecError(problems, arms[0].spec.source)


def _rounds(arms: list[Arm], updates: int, seed: int, device: torch.device, on_progress) -> None:
    """Update by update, every live configuration in a rotating order (no configuration always runs first)."""
    control = arms[0]
    for step in range(1, updates + 1):
        on_progress(f"update {step}/{updates}")
        live = [a for a in arms if a.live]
        k = step % len(live)
        for arm in live[k:] + live[:k]:  # an arm fails only in its own update: the others stay live
            _one_update(arm, step, seed, _pad(arm.spec, arm.driver), device,
                        beside=sum(1 for a in arms if a.live and a is not arm))
        if not control.live:
            break


def _median_seconds(arm: Arm) -> float | None:
    timed = [p.seconds for p in arm.points if p.step > MEASURED]
    return statistics.median(timed) if timed else None


def _inputs(arm: Arm, device) -> dict:
    t = arm.spec.train
    return {"precision": t.precision, "micro_batch_size": t.micro_batch_size, "grad_accum_steps": t.grad_accum_steps,
            "examples_per_update": t.micro_batch_size * t.grad_accum_steps, "max_length": arm.spec.data.max_length,
            "activation_checkpointing": t.activation_checkpointing, "device": str(device)}


MEMORY_SOURCE = ("live tensors of this configuration's model, optimizer and update (the allocator's counters would "
                 "include the other configurations this process holds)")


def _memory(arm: Arm) -> dict:
    mem: dict = {"peak_allocated_bytes": arm.peak, "peak_reserved_bytes": None, "source": MEMORY_SOURCE,
                 "not_measured": {"peak_reserved_bytes": "several configurations share one allocator in this process"}}
    if arm.peak is None:
        mem["not_measured"]["peak_allocated_bytes"] = arm.error or "no update was measured"
    return mem


def _control_row(arm: Arm, cfg, device, val_start: float | None) -> GateRow:
    s = _median_seconds(arm)
    if arm.error:
        verdict, reason = Verdict.FAIL, f"control: {arm.error}; no variant can be compared"
    else:
        verdict = Verdict.PASS
        reason = (f"control ({arm.spec.train.precision}, micro batch {arm.spec.train.micro_batch_size} x "
                  f"{arm.spec.train.grad_accum_steps}): peak {human_bytes(arm.peak)} live, "
                  f"{s * 1000:.1f} ms/update, val loss {arm.val:.4g} after {len(arm.points)} updates"
                  + (f" ({val_start:.4g} at the start)" if val_start is not None else "")
                  if s is not None and arm.val is not None else "control ran")
    details = VariantDetails(
        variant="control", kind=str(Kind.CONTROL), settings={}, what="the spec as written", experiment="control",
        held=None, changed=None, control_row=None, updates=len(arm.points), peak_live_bytes=arm.peak, peak_ratio=1.0,
        seconds_per_update=s, time_ratio=1.0, val_loss=arm.val, val_loss_rel_diff=0.0, numerics=None,
        same_initial_weights=True, error=arm.error, val_loss_start=val_start)
    return GateRow.now(VARIANT_ROW, verdict, reason, inputs=_inputs(arm, device), memory=_memory(arm), seconds=s,
                       details=details.to_dict())


def _variant_row(arm: Arm, control: Arm, control_id: int, cfg, device, val_start: float | None) -> GateRow:
    """The variant against ``control``: the control's arm, or the variant it is read against (``Variant.against``:
    fp8 against bf16), whose row is ``control_id``."""
    assert arm.variant is not None
    diff = compare_specs(control.spec, arm.spec)
    numerics = compare_updates(control.points, arm.points)
    ratio = time_ratio(control.points, arm.points, MEASURED + 1)
    peak_ratio = arm.peak / control.peak if arm.peak and control.peak else None
    rel = (rel_diff(arm.val, control.val)
           if arm.val is not None and control.val is not None and math.isfinite(arm.val) else None)
    if control.error:
        verdict, reason = Verdict.SKIP, f"{arm.name}: not compared: the {_called(control)} failed ({control.error})"
        experiment = "not compared"
    elif arm.not_compared:
        verdict, reason, experiment = Verdict.SKIP, f"{arm.name}: {arm.not_compared}", "not compared"
    else:
        j = judge(arm.name, str(arm.variant.kind), numerics, diff.question, arm.peak, control.peak, ratio, arm.val,
                  control.val, cfg.val_loss_rtol, start=val_start,
                  reference="the control" if control.variant is None else control.name)
        verdict, reason, experiment = j.verdict, j.reason, j.experiment
        if arm.error:
            verdict, reason = Verdict.FAIL, f"{arm.name}: {arm.error}" + (f"; {reason.split(': ', 1)[1]}"
                                                                          if arm.points else "")
        if arm.same_init is False:
            reason += ("; its model did not take the control's initial weights (its state dict differs: another "
                       "architecture or an adapter)")
        verdict, reason = _fp8_said(arm, control, verdict, reason, device)
    details = VariantDetails(
        variant=arm.name, kind=str(arm.variant.kind), settings=dict(arm.variant.settings), what=arm.variant.what,
        experiment=experiment, held=diff.held, changed={k: list(v) for k, v in diff.changed.items()},
        control_row=control_id, updates=len(arm.points), peak_live_bytes=arm.peak, peak_ratio=peak_ratio,
        seconds_per_update=_median_seconds(arm), time_ratio=ratio, val_loss=arm.val, val_loss_rel_diff=rel,
        numerics=numerics.to_dict(), same_initial_weights=arm.same_init, error=arm.error, val_loss_start=val_start)
    return GateRow.now(VARIANT_ROW, verdict, reason, inputs=_inputs(arm, device), memory=_memory(arm),
                       seconds=_median_seconds(arm), details=details.to_dict())


def _called(arm: Arm) -> str:
    return "control" if arm.variant is None else f"{arm.name} variant it is compared with"


def _fp8_said(arm: Arm, reference: Arm, verdict: Verdict, reason: str, device) -> tuple[Verdict, str]:
    """An fp8 row says what it converted and what it is measured against; where nothing was converted it measured
    nothing of float8 and is a skip saying so, whatever its numbers."""
    if arm.fp8 is None:
        return verdict, reason
    name, _, rest = reason.partition(": ")
    against = "the control" if reference.variant is None else f"{reference.name}, not the control"
    said = f"{name}: {arm.fp8.words()}; against {against}: {rest}"
    if torch.device(device).type == "cpu":  # the numerics hold; the time is not a GPU's
        said += ("; its time is torch._scaled_mm's CPU path, which says nothing of an FP8 GPU's speed "
                 "(pilotrun select predicts that)")
    if not arm.fp8.converted:
        return Verdict.SKIP, f"{name}: not measured: {arm.fp8.words()}; against {against}: {rest}"
    return verdict, said


def _metrics(arm: Arm) -> list[dict]:
    return [{"step": p.step, "loss": p.loss, "grad_norm": p.grad_norm, "seconds": p.seconds, "sample_ids": p.ids,
             "extra": {"variant": arm.name, "scaler_skipped": p.scaler_skipped, "scaler_updates": p.scaler_updates,
                       "memory_measured": p.step <= MEASURED}} for p in arm.points]


def _write(arms: list[Arm], spec, cfg, skipped: list[Skipped], ledger_path: Path | None, process,
           val_start: float | None) -> str:
    run_id = new_run_id(spec.name)
    with Ledger(ledger_path) as ledger:
        ledger.start_run(run_id, spec.name, RunKind.VARIANTS, spec_path=spec.source, config_hash=spec.config_hash(),
                         meta={"updates": cfg.updates, "val_loss_rtol": cfg.val_loss_rtol, "measured_updates": MEASURED,
                               "variants": [a.name for a in arms[1:]],
                               "skipped": {s.name: s.why for s in skipped}, "device": str(process.device),
                               "device_name": process.device_name})
        control = arms[0]
        row = _control_row(control, cfg, process.device, val_start)
        control_id = ledger.add_gate_row(run_id, row, _metrics(control))
        control.row = row
        verdicts = [row.verdict]
        ids = {control.name: control_id}
        for arm in arms[1:]:
            assert arm.variant is not None
            ref = next((a for a in arms[1:] if a.name == arm.variant.against), control)
            vrow = _variant_row(arm, ref, ids.get(ref.name, control_id), cfg, process.device, val_start)
            ids[arm.name] = ledger.add_gate_row(run_id, vrow, _metrics(arm))
            arm.row = vrow
            verdicts.append(vrow.verdict)
        ledger.end_run(run_id, RunStatus.of_verdicts(verdicts))
    return run_id
