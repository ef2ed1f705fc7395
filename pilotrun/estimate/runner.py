"""Traces on demand, shared by estimate, select, plan and the advisor: a trace is run once per variant.

Example::

    traces = Traces(spec)
    base = traces.get()                   # the spec as written
    ac = traces.get(ac=True)              # with activation checkpointing
    half = traces.get(precision="bf16")
"""
from __future__ import annotations

import json

from ..config.spec import Spec
from ..ledger.store import Ledger
from .catalog import Accelerator, matches
from .worker import trace_in_subprocess


class Traces:
    def __init__(self, spec: Spec, target: str = "cuda") -> None:
        self.spec = spec
        self.target = target
        self._cache: dict[tuple, dict] = {}

    def get(self, ac: bool | None = None, precision: str | None = None) -> dict:
        key = (ac if ac is not None else self.spec.train.activation_checkpointing,
               precision or self.spec.train.precision)
        if key not in self._cache:
            self._cache[key] = trace_in_subprocess(self.spec, self.target, ac=key[0], precision=key[1])
        return self._cache[key]


def calibrated_utilisation(ledger: Ledger | None, config_hash: str, acc: Accelerator, flops_per_update: float,
                           precision: str) -> tuple[float | None, str]:
    """Utilisation measured by a pilot of this config on this accelerator: FLOPs / (s per update × peak)."""
    if ledger is None:
        return None, "no ledger"
    peak = acc.peak_flops(precision)
    for run in ledger.runs(limit=500):
        if run.get("config_hash") != config_hash:
            continue
        for row in ledger.gate_rows(run["run_id"]):
            if row["gate"] != "steady_step" or row["verdict"] not in ("pass", "warn"):
                continue
            if not matches(acc, row["inputs"].get("device_name")):
                continue
            s = row["details"].get("seconds_per_update")
            if s and peak:
                return flops_per_update / (s * peak), f"measured by pilot {run['run_id']} ({s:.3g} s/update)"
    return None, "no pilot of this config on this accelerator in the ledger"


def stage_summary(trace: dict) -> dict:
    """The ``stages`` of the JSON output, with the checkpoint's save stage worked out from the trace."""
    out = {}
    for name, st in trace["stages"].items():
        out[name] = {"peak_bytes": st["peak_bytes"], "peak_bytes_rounded": st["peak_bytes_rounded"],
                     "breakdown": st["breakdown"], "flops": st["flops"], "seq_len": st["seq_len"],
                     "batch_size": st["batch_size"]}
    resident = trace["parameter_bytes"] + trace["optimizer_state_bytes"] + trace["buffer_bytes"]
    out["save"] = {
        "peak_bytes": resident,
        "checkpoint_bytes": resident,
        "note": ("after the step gradients are freed; torch.save copies one tensor at a time to host memory, so "
                 "the device holds parameters, optimizer state and buffers, and the host one shard at a time"),
    }
    return out


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
