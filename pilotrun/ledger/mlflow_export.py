"""Optional export of ledger runs to MLflow (``pip install 'pilotrun[mlflow]'``), e.g. its SQLite backend.

The ledger stays the record; MLflow gets a copy for teams that browse runs there. A campaign
becomes a parent run with its runs nested under it; a diverged, failed or refused run is
``FAILED`` (never dropped), a budget stop or a run never started is ``KILLED``, and the stop
reason and update travel as tags. Exporting twice does not duplicate: a run whose
``pilotrun.run_id`` tag is already in the experiment is skipped.

Example::

    with Ledger("runs/ledger.sqlite") as led:
        export_runs(led, selected_runs(led, "lr-sweep-2026"), "sqlite:///mlflow.db")
"""
from __future__ import annotations

import json
from datetime import datetime

from .records import RunKind, RunStatus, final_val_loss
from .store import Ledger

# pilotrun status -> MLflow RunStatus name. Anything not listed (running, planned) is still running.
STATUS = {RunStatus.FINISHED: "FINISHED", RunStatus.FINISHED_WITH_STOPS: "FINISHED", RunStatus.PASS: "FINISHED",
          RunStatus.WARN: "FINISHED", RunStatus.DIVERGED: "FAILED", RunStatus.FAILED: "FAILED",
          RunStatus.FAIL: "FAILED", RunStatus.ERROR: "FAILED", RunStatus.REFUSED: "FAILED",
          RunStatus.STOPPED: "KILLED", RunStatus.NOT_RUN: "KILLED", RunStatus.INTERRUPTED: "KILLED"}
BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch call


class MlflowUnavailable(Exception):
    """MLflow (with its SQL backend) is not installed: the message says what to install."""


def _client(uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise MlflowUnavailable("the MLflow export needs MLflow: pip install 'pilotrun[mlflow]' "
                                "(mlflow-skinny, sqlalchemy, alembic) or pip install mlflow") from None
    if uri.startswith("sqlite:"):
        import importlib.util

        if not (importlib.util.find_spec("alembic") and importlib.util.find_spec("sqlalchemy")):
            raise MlflowUnavailable("MLflow's SQLite backend needs sqlalchemy and alembic: "
                                    "pip install 'pilotrun[mlflow]'")
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its schema-migration INFO lines are not for our users
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def _ms(iso: str | None) -> int | None:
    return int(datetime.fromisoformat(iso).timestamp() * 1000) if iso else None


def metric_points(led: Ledger, run_id: str) -> list[tuple[str, float, int]]:
    """``(name, value, step)`` for every per-update number the ledger holds for a run
    (``train/loss``, ``val/loss``...)."""
    out = []
    for m in led.metrics(run_id):
        values = {"loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "data_wait_s": m["data_wait_s"]}
        values.update({k: v for k, v in (m["extra"] or {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if m["rank"]:
            values = {f"{k}.rank{m['rank']}": v for k, v in values.items()}
        out += [(f"{m['gate']}/{k}", float(v), int(m["step"])) for k, v in values.items() if v is not None]
    return out


def _params_tags(run: dict, meta: dict, led: Ledger) -> tuple[dict, dict]:
    params = {"pilotrun.kind": run["kind"], "config_hash": run["config_hash"] or ""}
    if "key" in meta and "variant" in meta:
        params[meta["key"]] = json.dumps(meta["variant"])
    if meta.get("seed") is not None:
        params["seed"] = meta["seed"]
    if run["kind"] == RunKind.CAMPAIGN:
        params.update({"vary": meta.get("key"), "values": json.dumps(meta.get("values")),
                       "seeds": json.dumps(meta.get("seeds"))})
    tags = {"pilotrun.run_id": run["run_id"], "pilotrun.status": run["status"], "mlflow.runName": run["run_id"]}
    for k in ("stop_reason", "stopped_at", "retry_of", "continues"):
        if meta.get(k) is not None:
            tags[f"pilotrun.{k}"] = str(meta[k])
    if meta.get("lock_drift"):
        tags["pilotrun.lock_drift"] = ", ".join(meta["lock_drift"])
    if run.get("parent_id"):
        tags["pilotrun.parent_id"] = run["parent_id"]
    conclusion = meta.get("conclusion")
    if conclusion:
        tags["pilotrun.conclusion"] = " ".join(conclusion.get("text", []))[:5000]
    for g in led.gate_rows(run["run_id"]):
        if run["kind"] != RunKind.CAMPAIGN_RUN:
            tags[f"gate.{g['gate']}"] = g["verdict"] + (f" (rank {g['rank']})" if g["rank"] else "")
    lock = json.loads(run.get("lock_json") or "null") or {}
    for k, v in (lock.get("versions") or {}).items():
        tags[f"lock.{k}"] = str(v)
    return {k: str(v)[:500] for k, v in params.items()}, {k: str(v) for k, v in tags.items()}


def _points(led: Ledger, run: dict, meta: dict) -> list[tuple[str, float, int]]:
    points = metric_points(led, run["run_id"])
    final = final_val_loss(run["status"], meta)
    if final is not None:
        points.append(("final/val_loss", float(final), int(meta["final"].get("step") or 0)))
    return points


def _log_points(client, rid: str, points: list[tuple[str, float, int]], t0: int = 0) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(name, value, t0, step) for name, value, step in points]
    for i in range(0, len(metrics), BATCH):
        client.log_batch(rid, metrics=metrics[i:i + BATCH])  # NaN and inf are kept: they are the divergence


def _catch_up(client, mlrun, run: dict, meta: dict, led: Ledger) -> str:
    """Log the points after the last step already there, refresh the tags, end it if the ledger has."""
    rid = mlrun.info.run_id
    last = {k: max((m.step for m in client.get_metric_history(rid, k)), default=-1) for k in mlrun.data.metrics}
    new = [p for p in _points(led, run, meta) if p[2] > last.get(p[0], -1)]
    _log_points(client, rid, new, _ms(run["started_at"]) or 0)
    for k, v in _params_tags(run, meta, led)[1].items():
        if k != "mlflow.runName":
            client.set_tag(rid, k, v)
    status = STATUS.get(run["status"])
    if status:
        client.set_terminated(rid, status=status, end_time=_ms(run["ended_at"]))
    return f"updated: {len(new)} new points" + (f", now {status}" if status else "")


def export_runs(led: Ledger, runs: list[dict], uri: str) -> list[dict]:
    """Copy ``runs`` (ledger rows) into MLflow at ``uri``; returns what was written or skipped, per run."""
    from mlflow.entities import Param

    client = _client(uri)
    done, parents = [], {}
    for run in runs:
        meta = json.loads(run.get("meta_json") or "{}")
        experiment = meta.get("campaign_id") or (run["run_id"] if run["kind"] == RunKind.CAMPAIGN else run["name"])
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        existing = client.search_runs([exp_id], filter_string=f"tags.`pilotrun.run_id` = '{run['run_id']}'")
        if existing:
            parents[run["run_id"]] = existing[0].info.run_id
            note = "already exported"
            if existing[0].info.status == "RUNNING":  # exported mid-run: bring it up to date, in place
                note = _catch_up(client, existing[0], run, meta, led)
            done.append({"run_id": run["run_id"], "mlflow_run_id": existing[0].info.run_id, "experiment": experiment,
                         "status": note})
            continue
        params, tags = _params_tags(run, meta, led)
        if meta.get("campaign_id") in parents:
            tags["mlflow.parentRunId"] = parents[meta["campaign_id"]]
        created = client.create_run(exp_id, start_time=_ms(run["started_at"]), tags=tags)
        rid = created.info.run_id
        parents[run["run_id"]] = rid
        client.log_batch(rid, params=[Param(k, v) for k, v in params.items()])
        _log_points(client, rid, _points(led, run, meta), _ms(run["started_at"]) or 0)
        status = STATUS.get(run["status"])
        if status:
            client.set_terminated(rid, status=status, end_time=_ms(run["ended_at"]))
        done.append({"run_id": run["run_id"], "mlflow_run_id": rid, "experiment": experiment,
                     "status": status or "RUNNING"})
    return done
