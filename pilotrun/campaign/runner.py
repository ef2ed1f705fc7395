"""One campaign run: train for the campaign's updates, validate every ``eval.every``, stop by the declared rules.

Runs in its own process (``python -m pilotrun.campaign.worker``), builds its job exactly as a pilot
does (:func:`pilotrun.drivers.build_job`), writes its per-update points to the shared ledger in
transactions (series ``train`` and ``val``), and ends its run row with a status and, when it stopped
early, the kind, the reason and the update it stopped at. A diverged run keeps every row it wrote.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from ..distributed import all_sum, env_from_os
from ..drivers import LoopDriver, NonFiniteError, build_job
from ..ledger.records import MANIFESTS, Kept, RunEnd, RunStatus, Series, StopKind
from ..ledger.store import Ledger
from ..program.env import StopRules
from ..train.batches import autocast_for, logits_of, loss_of, to_device
from ..train.evaluation import outputs_of
from .run_plan import CampaignRunPlan
from .stops import interrupted

# Points also reach the ledger at least this often, not only at validations: a run whose process or
# Ray node dies between two validations still has the updates it made (its stopped row cites the last one).
FLUSH_EVERY_S = 2.0


def control_predictions(model, data, spec, device, n: int, out_dir: Path) -> list[dict]:
    """Per example of the fixed control set: its loss and what the model predicts (class or next tokens).

    The collated control inputs and the model's outputs on them are written as safetensors
    (``control-inputs`` / ``control-outputs``), so an archived model can be rerun on exactly them."""
    out_rows = []
    was = model.training
    items = [data.val[i] for i in range(min(n, len(data.val)))]
    if items:
        batch = {k: v.contiguous() for k, v in data.collate(items).items() if isinstance(v, torch.Tensor)}
        save_file(batch, str(out_dir / "control-inputs.safetensors"))
        save_file({"outputs": outputs_of(model, to_device(batch, device)).contiguous()},
                  str(out_dir / "control-outputs.safetensors"))
    model.eval()
    try:
        with torch.no_grad(), autocast_for(device, spec.train.precision):
            for item in items:
                batch = to_device(data.collate([item]), device)
                out = model(**batch)
                logits = logits_of(out)
                row = {"id": str(item["id"]), "loss": float(loss_of(out))}
                if logits is not None and logits.ndim == 2:
                    row["predicted_class"] = int(logits.argmax(-1)[0])
                    row["target"] = int(batch["labels"][0]) if not batch["labels"].is_floating_point() else None
                elif logits is not None and logits.ndim == 3:
                    labels = batch["labels"][0]
                    pred = logits[0].argmax(-1)
                    mask = labels[1:] != -100
                    row["predicted_tokens"] = pred[:-1][mask].tolist()
                    row["target_tokens"] = labels[1:][mask].tolist()
                out_rows.append(row)
    finally:
        model.train(was)
    return out_rows


class _Recorder:
    """The run's per-update points, written to the ledger in batches (at each validation and at the end)."""

    def __init__(self, led: Ledger | RunSink, run_id: str, rank: int = 0) -> None:
        self.led, self.run_id, self.rank = led, run_id, rank
        self.pending: list[dict] = []
        self.first_loss: float | None = None
        self.flushed = time.monotonic()

    def update(self, rec) -> None:
        self.first_loss = rec.loss if self.first_loss is None else self.first_loss
        point = rec.metric()
        point["extra"] = {"examples_per_second": rec.examples / rec.seconds if rec.seconds else None}
        self.pending.append(point)
        if time.monotonic() - self.flushed > FLUSH_EVERY_S:  # a run killed between validations keeps its points
            self.flush()

    def non_finite(self, exc: NonFiniteError, lr: float) -> None:
        self.pending.append({"step": exc.step, "loss": exc.value if exc.what == "loss" else None, "lr": lr,
                             "sample_ids": exc.ids, "extra": {"non_finite": exc.what}})

    def flush(self) -> None:
        self.flushed = time.monotonic()
        if self.pending:
            self.led.add_metrics(self.run_id, Series.TRAIN, self.pending, rank=self.rank)
            self.pending = []

    def validation(self, step: int, v: dict) -> None:
        self.flush()
        if self.rank:  # every rank evaluates the same model: rank 0's point is the run's
            return
        self.led.add_metrics(self.run_id, Series.VAL, [{"step": step, "loss": v["val_loss"],
                                                        "extra": {"accuracy": v["accuracy"]}}])


def _train(driver: LoopDriver, plan: CampaignRunPlan, deadline: float | None, stop_requested: Callable[[], bool],
           rec: _Recorder, val: list[dict], how: Callable[[], str]) -> RunEnd:
    """The run's updates and validations until its end: finished, or stopped or diverged by a declared rule."""
    stop = plan.stop
    rules = StopRules.declared(stop, rec.first_loss)
    env = driver.env
    for step in range(1, plan.updates + 1):
        asked, late = stop_requested(), deadline is not None and time.time() > deadline
        if env.active:  # a group stops together or not at all (one rank alone would hang the others' collectives)
            asked = all_sum(env, float(asked), driver.device) > 0
            late = all_sum(env, float(late), driver.device) > 0
        if asked:
            return RunEnd(RunStatus.STOPPED, StopKind.INTERRUPTED, interrupted(how()), driver.step)
        if late:
            return RunEnd(RunStatus.STOPPED, StopKind.BUDGET, "budget: the campaign's time budget ran out",
                          driver.step)
        try:
            update = driver.update()
        except NonFiniteError as exc:
            if not rules.non_finite:
                raise
            rec.non_finite(exc, float(driver.scheduler.get_last_lr()[0]))
            return RunEnd(RunStatus.DIVERGED, StopKind.NON_FINITE, f"non-finite {exc.what} ({exc.value})", exc.step)
        rec.update(update)
        if (broken := rules.broken(update.loss)) is not None:   # the same rules a program's handle applies
            return RunEnd(RunStatus.DIVERGED, broken, rules.why(broken, update.loss), update.step)
        if step % plan.eval_every == 0 or step == plan.updates:
            v = driver.evaluate()
            val.append({"step": update.step, **v})
            rec.validation(update.step, v)
    return RunEnd(RunStatus.FINISHED)


def _keep(driver: LoopDriver, spec, plan: CampaignRunPlan, out_dir: Path, finished: bool) -> dict:
    """What a run leaves on disk: control-set predictions always, the checkpoint and export when it finished."""
    kept: dict = {}
    main = driver.env.is_main
    if main:
        preds = control_predictions(driver.plain_model, driver.data, spec, driver.device,
                                    plan.control_set, out_dir)
        (out_dir / "predictions.json").write_text(json.dumps(preds, indent=1))
        kept["control_predictions"] = str(out_dir / "predictions.json")
    # Each kept folder's manifest sha256 goes into the run's row (meta "manifests"), as a pilot's save and export
    # rows record theirs: what archive, convert and --resume admit, and nothing rewritten after the run.
    manifests: dict[str, str] = {}
    if plan.keep_checkpoint and finished:
        # Every rank: the strategy's layout (DCP shards for FSDP); the record carries the digest of the manifest bytes
        # written, never a re-read of the folder (a manifest swapped in after the rename is not kept as known).
        saved = driver.save(out_dir / "checkpoints" / "final")
        kept["checkpoint"] = str(out_dir / "checkpoints" / "final")
        if main:
            manifests[Kept.CHECKPOINT] = saved["manifest_sha256"]
    if plan.keep_export and finished:
        # Every rank takes part in gathering the full weights; rank 0 writes them (as the export gate does).
        weights = driver.export_weights() if driver.env.active else None
        if main:
            written = driver.write_export(out_dir / "export", weights)
            manifests[Kept.EXPORT] = written.manifest_sha256  # of the bytes written, not re-read
        kept["export"] = str(out_dir / "export")
    if manifests:
        kept[MANIFESTS] = {str(k): v for k, v in manifests.items()}
    return kept


class RunSink(Protocol):
    """Where a run's rows go: the ledger itself, or (on a Ray worker) a relay the driver drains into the ledger."""

    def __enter__(self) -> RunSink: ...
    def __exit__(self, *exc: object) -> None: ...
    def add_metrics(self, run_id: str, series: Series, points: list[dict], rank: int = 0) -> None: ...
    def finish_campaign_run(self, run_id: str, end: RunEnd, **fields: Any) -> None: ...


def train_run(spec, run_id: str, out_dir: Path, ledger_path: Path | None, plan: CampaignRunPlan, deadline: float | None,
              stop_requested: Callable[[], bool] = lambda: False, how: Callable[[], str] = lambda: "Ctrl-C",
              sink: RunSink | None = None) -> dict:
    """Train one run and record it; returns its final state. ``plan``: what every run of the campaign is told.

    ``stop_requested`` is polled between updates: a Ctrl-C stops the run at an update boundary, so
    no ledger write is cut in half and every update before it is kept exactly once. ``how`` names what
    stopped it (Ctrl-C, SIGTERM, ...) for the run's reason. ``sink`` replaces the ledger at ``ledger_path``
    where this process must not write it (a Ray worker: only the campaign's driver writes the ledger).
    """
    assert sink is not None or ledger_path is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.threads:  # runs side by side share the cores instead of each taking all of them
        torch.set_num_threads(plan.threads)
    result: dict = {"run_id": run_id, "val": []}
    with sink if sink is not None else Ledger(ledger_path) as led:
        try:
            driver = build_job(spec)
        except Exception as exc:
            # The run's own job could not be built (its model or data factory raised, a file is missing): the run
            # records that itself, so every engine keeps the same row. Left to propagate, a local worker would end
            # as "process lost" with a log to read and a Ray task as whatever Ray made of the error.
            end = RunEnd(RunStatus.FAILED, StopKind.ERROR,
                         f"building the job raised {type(exc).__name__}: {str(exc)[:300]}", 0)
            result.update(status=str(end.status), **end.fields(), final=None, first_loss=None)
            main = env_from_os()[0] == 0  # every rank of a group fails alike; rank 0 records the run's end
            if main:
                led.finish_campaign_run(run_id, end, final=None, first_loss=None)
                (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
            return result
        assert isinstance(driver, LoopDriver)
        rec = _Recorder(led, run_id, driver.env.rank)
        try:
            end = _train(driver, plan, deadline, stop_requested, rec, result["val"], how)
            rec.flush()
            result.update(_keep(driver, spec, plan, out_dir, end.status == RunStatus.FINISHED))
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep what was written
            end = RunEnd(RunStatus.STOPPED, StopKind.INTERRUPTED, interrupted(how()), driver.step)
            try:
                rec.flush()
            except KeyboardInterrupt:
                pass
        except Exception as exc:  # a crashed run keeps its rows and says why
            rec.flush()
            if stop_requested():  # e.g. DataLoader workers that took the Ctrl-C themselves and exited
                end = RunEnd(RunStatus.STOPPED, StopKind.INTERRUPTED,
                             f"{interrupted(how())}; then {type(exc).__name__}: {str(exc)[:200]}", driver.step)
            else:
                end = RunEnd(RunStatus.FAILED, StopKind.ERROR, f"{type(exc).__name__}: {str(exc)[:300]}",
                             driver.step)
        finally:
            driver.close()
        result.update(status=str(end.status), **end.fields())
        result["final"] = result["val"][-1] if result["val"] else None
        result["first_loss"] = rec.first_loss
        if driver.env.is_main:  # one end per run; the other ranks' rows are their points
            led.finish_campaign_run(run_id, end, final=result["final"], first_loss=rec.first_loss,
                                    **{MANIFESTS: result.get(MANIFESTS) or {}})
    if driver.env.is_main:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result
