"""One campaign run: train for the campaign's updates, validate every ``eval.every``, stop by the declared rules.

Runs in its own process (``python -m pilotrun.campaign.worker``), writes its metrics to the
shared ledger in transactions, and ends its run row with a status and, when it stopped early,
the reason and the update it stopped at. A diverged run keeps every row it wrote.
"""
from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import torch

from safetensors.torch import save_file

from ..checkpoint.export import export_model
from ..checkpoint.state import save_checkpoint
from ..gates.eval import val_metrics
from ..ledger.store import Ledger
from ..models.loading import load_tokenizer
from ..train.loop import NonFiniteError, _loss_of, autocast_for, to_device
from ..workers.reload import outputs_of


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
            for i in range(min(n, len(data.val))):
                item = data.val[i]
                batch = to_device(data.collate([item]), device)
                out = model(**batch)
                logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
                row = {"id": str(item["id"]), "loss": float(_loss_of(out))}
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


INTERRUPTED = "interrupted (Ctrl-C)"
# What the campaign sends a worker to stop it at the next update (SIGINT where there is no SIGUSR1).
STOP_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGINT)


def train_run(spec, run_id: str, out_dir: Path, ledger_path: Path, plan: dict, deadline: float | None,
              stop_requested=lambda: False) -> dict:
    """Train one run and record it; returns its final state. ``plan`` holds updates, eval_every, stop, keep.

    ``stop_requested`` is polled between updates: a Ctrl-C stops the run at an update boundary, so
    no ledger write is cut in half and every update before it is kept exactly once.
    """
    from ..workers.common import build_trainer

    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.get("threads"):  # runs side by side share the cores instead of each taking all of them
        torch.set_num_threads(plan["threads"])
    stop = plan["stop"]
    result = {"run_id": run_id, "status": "finished", "stop_reason": None, "stopped_at": None, "val": []}
    with Ledger(ledger_path) as led:
        trainer, data, device = build_trainer(spec)
        first_loss = None
        pending: list[dict] = []

        def flush(gate: str, rows: list[dict]) -> None:
            if rows:
                led.add_gate_row(run_id, {"gate": gate, "verdict": "pass", "reason": f"{len(rows)} point(s)",
                                          "inputs": {}, "memory": {}}, rows)

        try:
            for step in range(1, plan["updates"] + 1):
                if stop_requested():
                    result.update(status="stopped", stop_reason=INTERRUPTED, stopped_at=trainer.step)
                    break
                if deadline is not None and time.time() > deadline:
                    result.update(status="stopped", stop_reason="budget: the campaign's time budget ran out",
                                  stopped_at=trainer.step)
                    break
                try:
                    rec = trainer.update()
                except NonFiniteError as exc:
                    if not stop["non_finite"]:
                        raise
                    result.update(status="diverged", stop_reason=f"non-finite {exc.what} ({exc.value})",
                                  stopped_at=exc.step)
                    pending.append({"step": exc.step, "loss": exc.value if exc.what == "loss" else None,
                                    "lr": float(trainer.scheduler.get_last_lr()[0]), "sample_ids": exc.ids,
                                    "extra": {"non_finite": exc.what}})
                    break
                first_loss = rec.loss if first_loss is None else first_loss
                pending.append({"step": rec.step, "loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm,
                                "examples": rec.examples, "tokens": rec.tokens, "seconds": rec.seconds,
                                "data_wait_s": rec.data_wait_s, "sample_ids": rec.sample_ids,
                                "extra": {"examples_per_second": rec.examples / rec.seconds if rec.seconds else None}})
                if stop.get("divergence") and rec.loss > stop["divergence"] * first_loss:
                    result.update(status="diverged",
                                  stop_reason=f"loss {rec.loss:.4g} > {stop['divergence']:g} x the first loss {first_loss:.4g}",
                                  stopped_at=rec.step)
                    break
                if step % plan["eval_every"] == 0 or step == plan["updates"]:
                    flush("train", pending)
                    pending = []
                    v = val_metrics(trainer.model, data, spec, device)
                    result["val"].append({"step": rec.step, **v})
                    flush("val", [{"step": rec.step, "loss": v["val_loss"], "extra": {"accuracy": v["accuracy"]}}])
            flush("train", pending)
            preds = control_predictions(trainer.model, data, spec, device, plan["keep"]["control_set"], out_dir)
            (out_dir / "predictions.json").write_text(json.dumps(preds, indent=1))
            result["control_predictions"] = str(out_dir / "predictions.json")
            if plan["keep"]["checkpoint"] and result["status"] == "finished":
                save_checkpoint(out_dir / "checkpoints" / "final", trainer, spec.canonical(), spec.config_hash())
                result["checkpoint"] = str(out_dir / "checkpoints" / "final")
            if plan["keep"].get("export", True) and result["status"] == "finished":
                export_model(out_dir / "export", trainer.model,
                             tokenizer=load_tokenizer(spec) if spec.data.task is not None else None,
                             factory=spec.model.factory,
                             model_mapping=spec.model_mapping() if spec.model.factory else None,
                             spec_folder=str(spec.folder))
                result["export"] = str(out_dir / "export")
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep what was written
            result.update(status="stopped", stop_reason=INTERRUPTED, stopped_at=trainer.step)
            try:
                flush("train", pending)
            except KeyboardInterrupt:
                pass
        except Exception as exc:  # a crashed run keeps its rows and says why
            flush("train", pending)
            if stop_requested():  # e.g. DataLoader workers that took the Ctrl-C themselves and exited
                result.update(status="stopped", stop_reason=f"{INTERRUPTED}; then {type(exc).__name__}: "
                              f"{str(exc)[:200]}", stopped_at=trainer.step)
            else:
                result.update(status="failed", stop_reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                              stopped_at=trainer.step)
        finally:
            trainer.close()
        result["final"] = result["val"][-1] if result["val"] else None
        result["first_loss"] = first_loss
        led.finish_campaign_run(run_id, result)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)
