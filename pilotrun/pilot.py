"""Run the gates of one pilot in order; every gate writes one row to the ledger and ``report.json``.

This module decides nothing about presentation: an observer (the terminal UI,
or nothing in tests) is told when gates start, progress and end.

Example::

    from pilotrun.config import load_spec
    from pilotrun.pilot import PilotOptions, run_pilot
    result = run_pilot(load_spec("examples/tiny-sft/pilot.yaml"), PilotOptions())
    print(result.status, [r["verdict"] for r in result.rows])
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import torch

from . import distributed
from .config.spec import Spec
from .devices import device_name, pick_device
from .gates import GateFailure, Outcome, select_gates
from .gates.base import as_dict, failure_reason
from .gates.context import PilotContext
from .ledger.store import Ledger, now
from .measure.meter import StageMeter
from .resume_plan import plan_resume


class Observer(Protocol):
    def on_start(self, run_id: str, out_dir: Path, gates: list[str], notes: list[str]) -> None: ...
    def on_gate_start(self, gate: str) -> None: ...
    def on_progress(self, done: int, total: int, text: str) -> None: ...
    def on_gate_end(self, row: dict) -> None: ...


class _Quiet:
    def on_start(self, *a) -> None: ...
    def on_gate_start(self, *a) -> None: ...
    def on_progress(self, *a) -> None: ...
    def on_gate_end(self, *a) -> None: ...


@dataclass
class PilotOptions:
    out_dir: Path | None = None          # default: runs/<run_id>
    ledger_path: Path | None = None      # default: runs/ledger.sqlite ($PILOTRUN_LEDGER)
    gates: list[str] | None = None       # default: spec.pilot.gates, else all
    container_digest: str | None = None
    run_id: str | None = None
    resume: str | None = None            # "latest" or a run id: continue an interrupted pilot
    trust: bool = False                  # load a checkpoint whose manifest the ledger did not record


@dataclass
class PilotResult:
    run_id: str
    out_dir: Path
    ledger_path: Path
    rows: list[dict] = field(default_factory=list)   # this rank's rows
    status: str = "running"
    rank: int = 0
    world_size: int = 1
    all_rows: list[dict] = field(default_factory=list)  # every rank's rows (rank 0, distributed runs)

    @property
    def failed(self) -> bool:
        return any(r["verdict"] == "fail" for r in (self.all_rows or self.rows))

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def new_run_id(name: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def overall_status(rows: list[dict]) -> str:
    verdicts = {r["verdict"] for r in rows}
    if "fail" in verdicts:
        return "fail"
    if "warn" in verdicts:
        return "warn"
    return "pass"


def write_report(result: PilotResult, spec: Spec, extra: dict | None = None) -> Path:
    """``report.json``; with several ranks every rank writes ``report-rank{r}.json`` and rank 0 also the
    combined ``report.json`` with every rank's rows and a per-gate summary over ranks."""
    if result.world_size > 1:
        _write_json(result, spec, result.rows, result.out_dir / f"report-rank{result.rank}.json", extra)
        if result.rank != 0 or not result.all_rows:
            return result.out_dir / f"report-rank{result.rank}.json"
        extra = {**(extra or {}), "world_size": result.world_size, "ranks_summary": rank_summary(result.all_rows)}
        return _write_json(result, spec, result.all_rows, result.out_dir / "report.json", extra)
    return _write_json(result, spec, result.rows, result.out_dir / "report.json", extra)


def _write_json(result: PilotResult, spec: Spec, rows: list[dict], path: Path, extra: dict | None) -> Path:
    report = {
        "run_id": result.run_id,
        "name": spec.name,
        "spec": spec.source,
        "config_hash": spec.config_hash(),
        "out_dir": str(result.out_dir),
        "ledger": str(result.ledger_path),
        "status": result.status,
        "gates": [
            {k: r.get(k) for k in ("gate", "verdict", "reason", "inputs", "memory", "seconds", "rank", "world_size",
                                   "started_at", "ended_at", "details")}
            for r in rows
        ],
        **(extra or {}),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    return path


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _carried_row(parent_row: dict, parent_id: str) -> dict:
    """A gate the interrupted run already passed: its row, marked as carried, not re-measured."""
    row = {k: parent_row.get(k) for k in ("gate", "verdict", "reason", "inputs", "memory", "seconds", "started_at",
                                          "ended_at")}
    row["reason"] = f"carried from {parent_id}: {parent_row['reason']}"
    row["details"] = {**(parent_row.get("details") or {}), "carried_from": parent_id}
    return row


def _skip_row(gate, reason: str, inputs: dict) -> dict:
    t = now()
    return {"gate": gate.name, "verdict": "skip", "reason": reason, "inputs": inputs, "memory": {}, "seconds": None,
            "started_at": t, "ended_at": t, "details": {}}


def run_pilot(spec: Spec, options: PilotOptions | None = None, observer: Observer | None = None) -> PilotResult:
    """Run the selected gates; never raises for a gate failure (it becomes a row)."""
    options = options or PilotOptions()
    observer = observer or _Quiet()
    gates, notes = select_gates(options.gates or spec.pilot.gates)
    device, device_reason = pick_device(spec.train.device)
    env = distributed.init(spec.distributed.strategy, device.type)
    if env.active:
        if device.type == "cuda":
            device = torch.device("cuda", env.local_rank)
            device_reason = f"LOCAL_RANK {env.local_rank} chooses cuda:{env.local_rank}"
        if not env.is_main:
            observer = _Quiet()
        if options.resume:
            distributed.shutdown(env)
            raise distributed.LaunchError("--resume continues one process; resume a distributed pilot by running it again")
    run_id = distributed.broadcast(env, options.run_id or new_run_id(spec.name))
    out_dir = Path(options.out_dir) if options.out_dir else Path("runs") / run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(options.ledger_path)
    try:
        plan = (plan_resume(ledger, spec.name, options.resume, options.trust, spec.canonical(), spec.config_hash())
                if options.resume else None)
    except BaseException:
        ledger.close()
        raise
    if plan is not None:
        notes = notes + plan.notes
    result = PilotResult(run_id, out_dir, ledger.path)
    result.rank, result.world_size = env.rank, env.world_size
    if env.is_main:
        ledger.start_run(run_id, spec.name, "pilot", spec_path=spec.source, out_dir=str(out_dir.resolve()),
                         config_hash=spec.config_hash(), meta={"gates": [g.name for g in gates], "notes": notes,
                                                               "world_size": env.world_size,
                                                               "strategy": spec.distributed.strategy},
                         parent_id=plan.parent_id if plan else None)
    distributed.barrier(env)
    ctx = PilotContext(spec=spec, run_id=run_id, out_dir=out_dir, device=device, device_reason=device_reason,
                       ledger=ledger, container_digest=options.container_digest, progress=observer.on_progress,
                       rank=env.rank, world_size=env.world_size)
    ctx.env = env
    ctx.device_name = device_name(device)
    if plan is not None and plan.checkpoint is not None:
        ctx.resume_checkpoint = plan.checkpoint
        if "save" in plan.carried:
            ctx.checkpoint_dir, ctx.checkpoint_expect, ctx.checkpoint_manifest = plan.checkpoint, plan.expect, plan.manifest
        ctx.export_dir = plan.export_dir
        ctx.scan = plan.scan
    observer.on_start(run_id, out_dir, [g.name for g in gates], notes + [f"device: {device_reason}"])
    verdicts: dict[str, tuple[str, str]] = {}
    root_causes: dict[str, tuple[str, str]] = {}  # skipped gate -> the failed gate behind it
    hf_logger = logging.getLogger("transformers")
    old_level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    bars = _hf_progress_bars(False)
    try:
        for gate_cls in gates:
            gate = gate_cls()
            blockers = [d for d in gate.depends_on if verdicts.get(d, ("skip", ""))[0] in ("fail", "skip")]
            if not blockers and gate.needs_data and ctx.data_error is not None:
                first = next((r["gate"] for r in result.rows if r["verdict"] == "fail"), "an earlier gate")
                row = _skip_row(gate, f"skipped: the data could not be built in {first} ({_short(ctx.data_error)})",
                                gate.describe_inputs(ctx))
            elif plan is not None and gate.name in plan.carried:
                row = _carried_row(plan.carried[gate.name], plan.parent_id)
            elif blockers:
                dep = blockers[0]
                root, root_reason = root_causes.get(dep, (dep, verdicts[dep][1]))
                via = f"needs {dep}, skipped because " if root != dep else ""
                row = _skip_row(gate, f"skipped: {via}{root} failed ({_short(root_reason)})", gate.describe_inputs(ctx))
                root_causes[gate.name] = (root, root_reason)
            else:
                observer.on_gate_start(gate.name)
                row = _run_gate(gate, ctx)
            if row["verdict"] == "skip" and gate.name not in root_causes and not blockers:
                fail = next((r for r in result.rows if r["verdict"] == "fail"), None)
                root_causes[gate.name] = (fail["gate"], fail["reason"]) if fail else ("data", ctx.data_error or "")
            row["rank"], row["world_size"] = ctx.rank, ctx.world_size
            row = as_dict(row)
            metrics = row.pop("_metrics", [])
            verdicts[gate.name] = _agreed_verdict(env, row)
            ledger.add_gate_row(run_id, row, metrics)
            result.rows.append(row)
            write_report(result, spec)
            observer.on_gate_end(row)
        result.status = overall_status(result.rows)
        if env.active:
            result.all_rows = [r for rows in distributed.gather(env, result.rows) for r in rows]
            result.status = overall_status(result.all_rows)
    except KeyboardInterrupt:
        result.status = "interrupted"
        raise
    finally:
        hf_logger.setLevel(old_level)
        _hf_progress_bars(bars)
        if ctx.trainer is not None:
            ctx.trainer.close()
        ctx.trainer = ctx.loaded = None  # the DDP/FSDP model goes before the process group (distributed.shutdown)
        if result.status == "running":
            result.status = "error"
        if env.is_main:
            ledger.end_run(run_id, result.status)
        write_report(result, spec)
        ledger.close()
        if result.status not in ("error", "interrupted"):
            distributed.shutdown(env)
    return result


def _agreed_verdict(env, row: dict) -> tuple[str, str]:
    """With several ranks a gate counts as its worst rank: every rank then runs or skips the same gates,
    as the collectives inside them require."""
    if not env.active:
        return row["verdict"], row["reason"]
    order = {"fail": 0, "skip": 1, "warn": 2, "pass": 3}
    rows = distributed.gather(env, (row["verdict"], row["reason"], env.rank))
    verdict, reason, rank = min(rows, key=lambda v: order[v[0]])
    return verdict, (reason if rank == env.rank else f"rank {rank}: {reason}")


def rank_summary(rows: list[dict]) -> list[dict]:
    """Per gate over ranks: the worst verdict, the largest peak and time, and any imbalance worth a look."""
    by_gate: dict[str, list[dict]] = {}
    for r in rows:
        by_gate.setdefault(r["gate"], []).append(r)
    order = {"fail": 0, "skip": 1, "warn": 2, "pass": 3}
    out = []
    for gate, rs in by_gate.items():
        peaks = [(r.get("memory") or {}).get("peak_allocated_bytes") for r in rs]
        peaks = [p for p in peaks if p]
        secs = [r["seconds"] for r in rs if r.get("seconds")]
        flags = []
        # Relative and absolute: a few KiB of bookkeeping on one rank is not an imbalance.
        if len(peaks) > 1 and min(peaks) and max(peaks) / min(peaks) > 1.10 and max(peaks) - min(peaks) > 16 * 2**20:
            flags.append(f"memory differs across ranks by {max(peaks) / min(peaks) - 1:.0%}")
        if len(secs) > 1 and min(secs) > 0.05 and max(secs) / min(secs) > 1.25:
            flags.append(f"time differs across ranks by {max(secs) / min(secs) - 1:.0%}")
        worst = min(rs, key=lambda r: order[r["verdict"]])
        out.append({"gate": gate, "verdict": worst["verdict"], "ranks": len(rs),
                    "max_peak_allocated_bytes": max(peaks) if peaks else None,
                    "max_seconds": max(secs) if secs else None, "imbalance": flags, "worst_rank": worst.get("rank")})
    return out


def _hf_progress_bars(enabled: bool) -> bool:
    """transformers draws tqdm bars (e.g. while saving); the pilot draws its own. Returns the old setting."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return True
    old = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    return old


def _run_gate(gate, ctx: PilotContext) -> dict:
    started = now()
    outcome: Outcome
    caught: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StageMeter(ctx.device, track=gate.track(ctx), tensor_tracking=gate.tensor_tracking) as meter:
            try:
                outcome = gate.run(ctx, meter)
            except (Exception, SystemExit) as exc:  # a gate failure is a row, never a crash (sys.exit in user code too)
                inputs = gate.failure_inputs(ctx)
                if isinstance(exc, GateFailure):
                    inputs.update(exc.inputs)
                outcome = Outcome("fail", failure_reason(gate, exc, ctx, inputs), inputs,
                                  getattr(exc, "details", {}) or {})
                tb_path = ctx.out_dir / f"{gate.name}.traceback.txt"
                tb_path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
                outcome.details["traceback"] = str(tb_path)
    details = dict(outcome.details)
    messages = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught})
    if messages:
        details["warnings"] = messages[:20]
    return {
        "gate": gate.name,
        "verdict": outcome.verdict,
        "reason": outcome.reason or outcome.verdict,
        "inputs": outcome.inputs or gate.describe_inputs(ctx),
        "memory": outcome.memory if outcome.memory is not None else meter.memory,
        "seconds": meter.seconds,
        "started_at": started,
        "ended_at": now(),
        "details": details,
        "_metrics": outcome.metrics,
    }
