"""Traces on demand, shared by estimate, select, plan and the advisor: a trace is run once per variant, and
kept on disk (:mod:`.cache`) so that the next command on the same job reads it instead.

Example::

    traces = Traces(spec)
    base = traces.get()                   # the spec as written
    ac = traces.get(ac=True)              # with activation checkpointing
    half = traces.get(precision="bf16")
    traces.notes                          # one line per trace: cached or traced, and any cache problem
"""
from __future__ import annotations

import json
import time

from ..config.sections import ac_policy, ac_words
from ..config.spec import Spec
from ..ledger.details import SteadyStepDetails
from ..ledger.records import GateName, Verdict
from ..ledger.store import Ledger
from .cache import CacheStatus, TraceCache, trace_key
from .catalog import Accelerator, matches
from .lengths import DataLengths, data_lengths
from .worker import trace_in_subprocess


class Traces:
    """``cache=None`` traces every variant afresh (and keeps nothing on disk); ``refresh=True`` ignores what
    the cache holds but writes the new traces to it (``--no-trace-cache``)."""

    def __init__(self, spec: Spec, target: str = "cuda", cache: TraceCache | None = None,
                 refresh: bool = False) -> None:
        self.spec = spec
        self.target = target
        self.disk = cache
        self.refresh = refresh
        self.notes: list[str] = []
        self._cache: dict[tuple, dict] = {}
        self._lengths: DataLengths | None = None

    def get(self, ac: bool | str | None = None, precision: str | None = None) -> dict:
        """The trace with activation checkpointing ``ac`` (a train.activation_checkpointing value; None: the
        spec's) and ``precision`` (None: the spec's)."""
        key = (ac if ac is not None else self.spec.train.activation_checkpointing,
               precision or self.spec.train.precision)
        if key not in self._cache:
            self._cache[key] = self._load(*key)
        # distributed.offload changes no traced tensor (it is not in the cache key): the job's choice travels with
        # the trace to the estimate (estimate/offload.py), stamped on each answer, never on the cached trace.
        return {**self._cache[key], "offload": self.spec.distributed.offload}

    def lengths(self) -> DataLengths:
        """The lengths the spec's data gives its micro batches, for the time (lengths.data_lengths): read once, and
        kept beside the cached traces."""
        if self._lengths is None:
            self._lengths = data_lengths(self.spec, self.disk.folder.parent / "lengths" if self.disk else None)
        return self._lengths

    def _load(self, ac: bool | str, precision: str) -> dict:
        policy = ac_policy(ac)
        what = f"trace ({'without activation checkpointing' if policy is None else 'with ' + ac_words(policy)}, " \
               f"{precision})"
        if self.disk is None:
            return trace_in_subprocess(self.spec, self.target, ac=ac, precision=precision)
        key = trace_key(self.spec, self.target, ac, precision)
        if not self.refresh:
            hit = self.disk.get(key)
            if hit.status is CacheStatus.HIT and hit.trace is not None:
                self.notes.append(f"{what}: {hit.note}")
                return hit.trace
            if hit.status is CacheStatus.UNUSABLE:
                self.notes.append(f"{what}: {hit.note}")
        trace = trace_in_subprocess(self.spec, self.target, ac=ac, precision=precision)
        problem = self.disk.put(key, trace, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.notes.append(f"{what}: traced in {trace['seconds']:.1f} s"
                          + (f"; {problem}" if problem else f", cached as {self.disk.path(key)}"))
        return trace


def calibrated_utilisation(ledger: Ledger | None, config_hash: str, acc: Accelerator, flops_per_update: float,
                           precision: str) -> tuple[float | None, str]:
    """Utilisation measured by a pilot of this config on this accelerator: FLOPs / (s per update × peak)."""
    if ledger is None:
        return None, "no ledger"
    peak = acc.peak_flops(precision)
    for run in ledger.runs(limit=500):
        if run.get("config_hash") != config_hash:
            continue
        for row in ledger.gate_records(run["run_id"]):
            if row.gate != GateName.STEADY_STEP or row.verdict not in (Verdict.PASS, Verdict.WARN):
                continue
            if not matches(acc, row.inputs.get("device_name")):
                continue
            s = SteadyStepDetails.of(row.details).seconds_per_update
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
    adapter = (trace.get("adaptation") or {}).get("adapter_bytes", 0)
    out[GateName.SAVE] = {
        "peak_bytes": resident,
        # An adapter job's checkpoint holds the adapter and its optimizer state, never the frozen base.
        "checkpoint_bytes": adapter + trace["optimizer_state_bytes"] if adapter else resident,
        "note": ("after the step gradients are freed; torch.save copies one tensor at a time to host memory, so "
                 "the device holds parameters, optimizer state and buffers, and the host one shard at a time"
                 + ("; the checkpoint holds the adapter and optimizer state only (the frozen base is named by its "
                    "revision and hash in the lock)" if adapter else "")),
    }
    return out


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
