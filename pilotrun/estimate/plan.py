"""The rental plan: the whole pipeline's time on the chosen configuration, and what 3, 7 or 30 days buy.

Every figure says where it came from: measured by a pilot in the ledger, estimated
from a trace, or an assumption you can change with a flag. Evaluation and export
time is always reserved.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..ledger.details import ExportDetails, SaveDetails, SteadyStepDetails
from ..ledger.records import GateName, GateRow, TextEnum, Verdict
from .experiments import adapter_view

PLANS_DAYS = (3, 7, 30)
MARGIN = 0.20  # operational margin a plan must keep free (restarts, queueing, debugging)


@dataclass
class Assumptions:
    download_mb_s: float = 200.0          # model and data download
    egress_mb_s: float = 100.0            # copying results off the node
    disk_mb_s: float = 1000.0             # checkpoint writes when no pilot measured them
    evals_per_run: int = 10
    checkpoints_per_run: int = 10
    data_bytes: int = 0                   # dataset bytes to download (0: already on the node)
    # Spot (preemptible) capacity, with --spot: no public source gives a rate per accelerator and cloud; these are
    # assumptions printed with their value, like the speeds above.
    preemptions_per_day: float = 1.0
    relaunch_minutes: float = 15.0        # a managed job's recovery: a new node, the setup (torch and the lock) again

    def to_dict(self) -> dict:
        return asdict(self)


class Item(TextEnum):
    """The items of one run's pipeline, in the order the plan lists them. The value is the item's name in the
    table and the JSON (``item``); code finds an item by its member, never by a piece of its name."""

    MODEL_DOWNLOAD = "model download"
    DATA_DOWNLOAD = "data download"
    PREPARATION = "preprocessing and load"
    COMPILE = "torch.compile (each process start)"  # train.compile: once per start, again after each preemption
    TRAINING = "training"
    DATA_WAIT = "data loading (not overlapped)"  # the share of update time the loop waited on data
    VALIDATION = "validation"
    CHECKPOINTS = "checkpoints"
    EXPORT = "export"
    MERGED_EXPORT = "merged export (export.merge)"
    COPY_OFF = "copy results off"
    RECOVERY = "spot recovery (expected)"  # with --spot: relaunches and the work a preemption makes redo


def _last_rows(ledger, config_hash: str) -> tuple[str | None, dict[str, GateRow]]:
    """The most recent pilot of this config (any device) with passing rows: its id and those rows by gate (data
    wait, eval and save costs); (None, {}) without one."""
    if ledger is None:
        return None, {}
    for run in ledger.runs(limit=500):
        if run.get("config_hash") != config_hash or run["kind"] != "pilot":
            continue
        rows = {r.gate: r for r in ledger.gate_records(run["run_id"]) if r.verdict in (Verdict.PASS, Verdict.WARN)}
        if rows:
            return run["run_id"], rows
    return None, {}


def pipeline_hours(spec, row: dict, trace: dict, ledger=None, a: Assumptions | None = None,
                   download: dict | None = None, spot: bool = False) -> dict:
    """Hours (and, with a price, cost) of one run, item by item, on the sheet row's configuration.

    ``download`` is :func:`pilotrun.estimate.source.model_download`'s answer: what the node fetches
    follows the model source (nothing for a config-built model), never the parameter count.
    ``spot``: the node may be preempted; the expected recovery is an item of its own (:func:`recovery_item`) and the
    cost is at the spot price (the on-demand one, said so, when the catalog has none)."""
    a = a or Assumptions()
    pilot_id, pilot = _last_rows(ledger, spec.pilot_hash())
    source = f"pilot {pilot_id}" if pilot else None
    items: list[dict] = []

    def add(name: Item, seconds, how):
        items.append({"item": name, "hours": seconds / 3600 if seconds is not None else None, "from": how})

    adapter = adapter_view(trace, spec)
    if adapter is not None:  # the export is the PEFT adapter; the merged model comes as its own item
        weights = adapter["adapter_bytes"]
    else:
        weights = trace["parameter_bytes"] // (2 if spec.train.precision != "fp32" else 1)  # the exported copy
    dl = download or {"bytes": None, "reason": "not measured: the model source was not looked at"}
    add(Item.MODEL_DOWNLOAD, dl["bytes"] / (a.download_mb_s * 1e6) if dl["bytes"] is not None else None,
        f"{dl['reason']}" + (f", at {a.download_mb_s:g} MB/s (assumed)" if dl["bytes"] else ""))
    add(Item.DATA_DOWNLOAD, a.data_bytes / (a.download_mb_s * 1e6),
        f"{a.data_bytes / 1e9:.1f} GB (--data-gb) at {a.download_mb_s:g} MB/s (assumed)" if a.data_bytes else
        "0 GB: the data is assumed on the node already (--data-gb gives its size)")
    # A program's inspect row is an integration's probe with no time of its own: only timed rows count.
    timed = [g for g in (GateName.INSPECT, GateName.LOAD) if g in pilot and pilot[g].seconds is not None]
    prep = sum(pilot[g].seconds or 0.0 for g in timed) if timed else None
    add(Item.PREPARATION, prep, f"measured by {source} ({' + '.join(map(str, timed))})" if prep is not None else
        "not measured: run a pilot of this spec" if not pilot else f"not measured: {source} timed no inspect or load")
    compile_s = _compile_item(spec, pilot, source, add)
    train_s = row["seconds_per_update"] * spec.train.updates if row.get("seconds_per_update") else None
    add(Item.TRAINING, train_s, f"{spec.train.updates} updates x {row['seconds_per_update']:.3g} s "
        f"({row['utilisation_source']})" if train_s else "no time estimate")
    steady = pilot.get(GateName.STEADY_STEP)
    wait = SteadyStepDetails.of(steady.details).data_wait_share if steady else None
    add(Item.DATA_WAIT, train_s * wait if (train_s and wait is not None) else None,
        f"{wait:.0%} of update time waited on data in {source}" if wait is not None else "not measured")
    eval_row = pilot.get(GateName.EVAL)
    eval_measured = eval_row.seconds if eval_row is not None else None
    eval_s = eval_measured * a.evals_per_run if eval_measured is not None else None
    add(Item.VALIDATION, eval_s, f"{a.evals_per_run} evaluations x {eval_measured:.3g} s measured by {source}"
        if eval_measured is not None else "not measured: run a pilot (eval gate)")
    ckpt_bytes = adapter["checkpoint_bytes"] if adapter else trace["parameter_bytes"] + trace["optimizer_state_bytes"]
    bw, job_bw, how = _save_speeds(pilot.get(GateName.SAVE), source, a)
    add(Item.CHECKPOINTS, a.checkpoints_per_run * ckpt_bytes / job_bw,
        f"{a.checkpoints_per_run} x {ckpt_bytes / 1e9:.1f} GB at {job_bw / 1e6:.0f} MB/s ({how})")
    add(Item.EXPORT, weights / bw, f"{weights / 1e9:.1f} GB of {'adapter ' if adapter else ''}weights at "
        f"{bw / 1e6:.0f} MB/s")
    merged = adapter["merged_export"] if adapter else None
    if merged:
        add(Item.MERGED_EXPORT, merged["bytes"] / bw,
            f"{merged['bytes'] / 1e9:.1f} GB: the base with the adapter merged in, at {bw / 1e6:.0f} MB/s")
        weights += merged["bytes"]
    add(Item.COPY_OFF, (ckpt_bytes + weights) / (a.egress_mb_s * 1e6),
        f"last checkpoint + export at {a.egress_mb_s:g} MB/s (assumed)")
    cost_note = row.get("cost_note")
    price, gpus = row.get("price_per_gpu_hour"), row["gpus"]
    if spot:
        items.append(recovery_item(sum(i["hours"] for i in items if i["hours"] is not None),
                                   train_s / 3600 if train_s else None, a, (compile_s or 0) / 3600))
        if row.get("spot_price_per_gpu_hour") is not None:
            price, cost_note = row["spot_price_per_gpu_hour"], None
        elif price is not None:
            cost_note = (f"no spot price for {row['accelerator']}: costs use the on-demand price_per_gpu_hour; add "
                         "spot_price_per_gpu_hour in a --catalog file (docs/catalog.md)")
    # The node is rented for the whole pipeline, so every item costs GPUs x hours x price.
    for i in items:
        i["cost"] = i["hours"] * gpus * price if (i["hours"] is not None and price is not None) else None
    known = [i["hours"] for i in items if i["hours"] is not None]
    sizes = _sizes(pilot, source, ckpt_bytes, weights, adapter is not None, spec.train.precision, dl, a)
    return {"items": items, "hours": sum(known), "unknown": [i["item"] for i in items if i["hours"] is None],
            "cost": sum(known) * gpus * price if price is not None else None,
            "cost_note": cost_note, "measured_by": source, "spot": spot, "price_per_gpu_hour": price, "sizes": sizes}


def _compile_item(spec, pilot: dict[str, GateRow], source: str | None, add) -> float | None:
    """train.compile's item: the compile seconds a pilot of this spec measured (its first_step row's details), once
    per process start; unknown until measured (never a guess). The seconds, or None."""
    if spec.train.compile == "off":
        return None
    first = pilot.get(GateName.FIRST_STEP)
    measured = first.details.get("compile_seconds") if first is not None else None
    add(Item.COMPILE, measured, f"{measured:.3g} s measured by {source} (first_step compile_seconds), once per "
        "process start (a resume after a preemption compiles again)" if measured is not None else
        "compile time: not measured (unknown): run a pilot of this spec to measure it")
    return measured


def _save_speeds(save_row: GateRow | None, source: str | None, a: Assumptions) -> tuple[float, float, str]:
    """(the write speed, the speed the job waits at, how both were known), in bytes per second. A checkpoint costs
    the run what the job waits for it: the copy to host memory when the save is written behind the job (rows from
    before that was possible waited for the whole write, their bytes_per_second)."""
    saved = SaveDetails.of(save_row.details if save_row is not None else None)
    bw = saved.bytes_per_second or a.disk_mb_s * 1e6
    job_bw = saved.blocking_bytes_per_second or bw
    if save_row is None:
        return bw, job_bw, "assumed"
    if saved.bytes_per_second is None:  # a program's save stage: its time, not the bytes its own format wrote
        return bw, job_bw, f"assumed: {source}'s save row has no bytes written (the program's own checkpoint)"
    if job_bw != bw:
        return bw, job_bw, f"what the job waited in {source}; written at {bw / 1e6:.0f} MB/s behind it"
    return bw, job_bw, f"measured by {source}"


def _sizes(pilot: dict[str, GateRow], source: str | None, ckpt_bytes: int, weights: int, adapter: bool,
           precision: str, dl: dict, a: Assumptions) -> dict:
    """What one checkpoint and one export take on disk (measured by the pilot where it saved and exported, else
    from the trace), and what the node downloads: the disk a SkyPilot task asks for."""
    save, export = pilot.get(GateName.SAVE), pilot.get(GateName.EXPORT)
    measured_ckpt = SaveDetails.of(save.details if save is not None else None).bytes
    measured_export = ExportDetails.of(export.details if export is not None else None).bytes
    return {
        "per_checkpoint": {"bytes": measured_ckpt, "from": f"measured by {source} (save)"} if measured_ckpt else
        {"bytes": ckpt_bytes, "from": "estimated from the trace: " + ("the adapter and its optimizer state" if adapter
                                                                      else "parameters + optimizer state")},
        "per_export": {"bytes": measured_export, "from": f"measured by {source} (export)"} if measured_export else
        {"bytes": weights, "from": "estimated from the trace: " + ("the adapter" if adapter else
                                                                   f"the weights in {precision}")},
        "model_download": {"bytes": dl["bytes"], "from": dl["reason"]},
        "data_download": {"bytes": a.data_bytes, "from": "--data-gb" if a.data_bytes else "no download (--data-gb)"},
    }


def recovery_item(hours: float, train_hours: float | None, a: Assumptions, compile_hours: float = 0.0) -> dict:
    """The expected cost in hours of running ``hours`` of pipeline on spot capacity: preemptions at
    ``a.preemptions_per_day``, each a relaunch (a new node and the setup again) plus the work it makes redo. A
    campaign run a preemption cuts short runs again from its start (``pilotrun campaign --resume``), so half a run's
    training is redone on average; a compiled job (``compile_hours`` per start) compiles again. First order: a
    preemption during the recovery itself is not counted."""
    preemptions = hours / 24 * a.preemptions_per_day
    redo = train_hours / 2 if train_hours else 0.0
    each = a.relaunch_minutes / 60 + redo + compile_hours
    how = (f"{preemptions:.2f} expected preemption(s) in {hours:.1f} h at {a.preemptions_per_day:g}/day "
           f"(assumed, --preemptions-per-day), each {a.relaunch_minutes:g} min to relaunch and set up again "
           f"(assumed, --relaunch-minutes)")
    how += (f" + {redo:.2f} h redone (half a run's training: a campaign run cut short runs again from its start)"
            if train_hours else "; the training time is unknown, so the work redone is not counted")
    how += f" + {compile_hours * 3600:.3g} s compiling again" if compile_hours else ""
    return {"item": Item.RECOVERY, "hours": preemptions * each, "from": how}


def rental_plans(row: dict, per_run: dict, runs: int) -> list[dict]:
    """3, 7 and 30 days on the row's GPUs: the runs that fit with the margin kept, and whether to take it."""
    hours = per_run["hours"] * runs
    calibrated = bool(row.get("utilisation_measured"))
    out = []
    for days in PLANS_DAYS:
        available = days * 24 * (1 - MARGIN)
        fits = per_run["hours"] > 0 and hours <= available
        runs_fit = int(available // per_run["hours"]) if per_run["hours"] else 0
        advice = []
        if days == 7:
            advice.append("suits compatibility checks and profiling before a long rental")
        if fits and days == min(d for d in PLANS_DAYS if per_run["hours"] * runs <= d * 24 * (1 - MARGIN)):
            advice.insert(0, "the shortest plan that holds the work with the margin")
        if days == 30 and not calibrated:
            advice.append("not recommended yet: no measured pilot on this accelerator backs the time estimate")
        if per_run["unknown"]:
            advice.append("unmeasured items: " + ", ".join(per_run["unknown"]))
        out.append({
            "days": days, "gpus": row["gpus"], "gpu_hours": days * 24 * row["gpus"],
            "work_hours": hours, "fits_with_margin": fits, "runs_that_fit": runs_fit,
            "margin_hours": days * 24 - hours, "advice": advice,
            "cost": (days * 24 * row["gpus"] * row["price_per_gpu_hour"]) if row.get("price_per_gpu_hour") else None,
            "work_cost": (hours * row["gpus"] * row["price_per_gpu_hour"]) if row.get("price_per_gpu_hour") else None,
            "cost_note": (None if row.get("price_per_gpu_hour")
                          else "no price in the catalog: add price_per_gpu_hour (--catalog, docs/catalog.md)"),
        })
    return out


def more_gpus_advice(row: dict, per_run: dict) -> str:
    """More GPUs only when compute, not communication or input, is the limit."""
    hours = {i["item"]: i["hours"] for i in per_run["items"]}
    wait_share = (hours.get(Item.DATA_WAIT) or 0) / max(hours[Item.TRAINING] or 1e-9, 1e-9)
    if row.get("bound") == "communication":
        return "no: communication already dominates the update; more GPUs would add to it"
    if wait_share > 0.10:
        return f"no: the input pipeline takes {wait_share:.0%} of training time; fix it first"
    if row.get("bound") == "memory":
        return ("yes, if the deadline needs it: the update is bound by memory traffic, and the micro batches' "
                "traffic splits over more GPUs as their FLOPs do (the optimizer step's only when it is sharded)")
    return "yes, if the deadline needs it: the update is compute-bound"
