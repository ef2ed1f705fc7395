"""What a gate row's ``details`` hold, as types, for the gates whose details other modules read.

The gate builds its structure and stores ``to_dict()`` (the JSON keys rows have always had); a reader
(the estimate, plan and select, the console, the HTML report, the archive, ``--resume``) reads a row's
details back with ``of()``. ``of()`` takes any mapping: keys a row lacks are ``None`` (rows written before
a key existed, rows a program or an integration reported, a failure row's own details) and keys it does
not know are ignored (the pilot's ``warnings``, ``failure``, ``carried_from``).

This module is in the foundation layer beside :mod:`.records` because the writers (``gates/``) and the
readers are in layers above it, and ``checkpoint/`` (below ``gates/``) reads the manifests rows record.

Example::

    steady = SteadyStepDetails.of(row.get("details"))
    steady.seconds_per_update          # None for a program's steady_step row, which times no update
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="RowDetails")


@dataclass(frozen=True)
class RowDetails:
    """A gate's details as a frozen dataclass (subclasses): ``to_dict`` for the row, ``of`` to read one back."""

    # A field -> the fields a row holds only when that one is set (written in some cases only: an adapter's
    # counts, a resumed load's checkpoint). The rest are always written, ``None`` included.
    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def of(cls: type[T], details: Mapping[str, Any] | None) -> T:
        """The structure of a row's details (any mapping, or None): missing keys are None, unknown keys ignored."""
        found = details if isinstance(details, Mapping) else {}
        return cls(**{f.name: found.get(f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        """The row's details, in the keys and order the gate has always written."""
        unset = {k for owner, keys in self.WRITTEN_WITH.items() if getattr(self, owner) is None for k in keys}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in unset}


@dataclass(frozen=True)
class LoadDetails(RowDetails):
    """``load``: the model, data and wrapping as built."""

    model_class: str | None                  # the model's class name
    source: str | None                       # where the model came from (config, folder, Hub id, factory)
    head: str | None                         # causal-lm, seq-classification or custom
    parameters: int | None                   # every parameter, counted once
    trainable_parameters: int | None         # those that train (an adapter's alone: the split's count)
    parameter_bytes: int | None              # the parameters' bytes as stored
    parameter_dtypes: list[str] | None       # the parameters' dtypes, sorted
    device_choice: str | None                # which device and why
    loss_normalization: str | None           # how the loss is normalised over accumulation, and why
    data_sizes: dict[str, int] | None        # examples per split
    label_names: list[str] | None            # a classification task's classes
    notes: list[str] | None                  # what the model builder and the data did that a person should know
    updates_per_epoch: int | None
    strategy: str | None                     # how the strategy wrapped the model
    gradient_reduction: str | None           # one process, or what the reduction over ranks measured
    examples_per_update: int | None          # micro batch x accumulation x data replicas
    optimizer: dict | None                   # {name, fused, reason}: the optimizer built and why
    precision: str | None                    # train.precision
    # An adapter (model.adapter), written with base_identity: trainable vs frozen (models.adapters.ParameterSplit).
    frozen_parameters: int | None = None
    trainable_bytes: int | None = None       # the adapter's bytes as stored
    frozen_bytes: int | None = None          # the frozen base's bytes as stored (a 4-bit weight's packed bytes)
    trainable_share: float | None = None     # trainable / all parameters
    base_identity: str | None = None         # the frozen base's sha256 as built
    # --resume: the checkpoint the driver was restored from and its step.
    restored_from: str | None = None
    restored_step: int | None = None

    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {
        "base_identity": ("frozen_parameters", "trainable_bytes", "frozen_bytes", "trainable_share", "base_identity"),
        "restored_from": ("restored_from", "restored_step"),
    }


@dataclass(frozen=True)
class SteadyStepDetails(RowDetails):
    """``steady_step``: time per update over the timed updates (the first steady update is tracked, not timed)."""

    seconds_per_update: float | None             # mean over the timed updates
    median_seconds_per_update: float | None
    examples_per_second: float | None
    tokens_per_second: float | None
    data_wait_seconds_per_update: float | None   # the loop's wait for the next batch, per update
    data_wait_share: float | None                # that wait as a share of update time (0..1)
    memory_measured_on_update: int | None        # the update whose tensors were tracked
    timed_updates: list[int] | None              # which updates were timed
    losses: list[float] | None                   # every steady update's loss
    timed_seq_len_max: int | None                # the longest sequence among the timed updates
    note: str | None = None                      # only with one steady update: its time includes tracking

    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {"note": ("note",)}


@dataclass(frozen=True)
class SaveDetails(RowDetails):
    """``save``: the checkpoint written and how fast (a failed save's row holds ``path`` and its own keys)."""

    path: str | None                      # the checkpoint folder
    bytes: int | None                     # all its files
    files: Any                            # the files the strategy wrote (their names, as the strategy lists them)
    step: int | None                      # the update the state is at
    layout: str | None                    # the strategy's checkpoint layout
    bytes_per_second: float | None        # write speed (None when the write took no measurable time)
    write_seconds: float | None
    manifest_sha256: str | None           # of the checkpoint's manifest: what makes it known to restore/--resume
    expect: str | None                    # this rank's fingerprints file, which restore must reproduce
    expect_sha256: list[str] | None = None  # every rank's expect file's sha256 as written (rank order)
    stale_temps_removed: list[dict] | None = None  # [{path, bytes}] of killed saves' temp folders removed first
    # What the job waited: a background save's copy to host memory, or the whole write of one written before it
    # returned (then equal to write_seconds); None in rows written before saves could run behind the job.
    blocking_seconds: float | None = None
    blocking_bytes_per_second: float | None = None  # bytes / blocking_seconds: what the plan charges per checkpoint

    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {"stale_temps_removed": ("stale_temps_removed",),
                                                          "expect_sha256": ("expect_sha256",),
                                                          "blocking_seconds": ("blocking_seconds",
                                                                               "blocking_bytes_per_second")}


@dataclass(frozen=True)
class ExportDetails(RowDetails):
    """``export``: the inference artifact written (pilotrun's, or a framework's own save inside a program)."""

    path: str | None                      # the export folder
    files: dict[str, dict] | None         # relative path -> {bytes, sha256}
    bytes: int | None                     # all its files
    tensors: int | None                   # tensors in its safetensors files
    manifest_sha256: str | None           # of its manifest: what makes it known to reload_eval, --resume, archive
    # An adapter export (model.adapter), written with adapter: True.
    adapter: bool | None = None
    base_identity: str | None = None      # the frozen base's sha256, from base.json
    merged: str | None = None             # the merged model's folder, when export.merge wrote one
    merge_note: str | None = None         # why a requested merge was not written
    # A framework's own save inside a program (an integration's export): which one wrote it.
    written_by: str | None = None

    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {
        "adapter": ("adapter", "base_identity", "merged", "merge_note"), "written_by": ("written_by",)}


@dataclass(frozen=True)
class OverfitDetails(RowDetails):
    """``overfit``: the tiny subset's training."""

    memory_note: str | None               # why the row's memory is above the job's (the check's model copy)
    losses: list[float] | None            # the loss of every update, in order
    checks: list[dict] | None             # [{update, loss, accuracy}] of the subset's own targets
    ids: list[str] | None                 # the subset's example ids
    updates: int | None                   # updates run
    thresholds: dict | None               # {loss_below, accuracy_at_least, loss_below_from}
    # How the subset's targets were scored when not one example at a time (a framework's loss that needs a batch).
    scored: str | None = None
    WRITTEN_WITH: ClassVar[dict[str, tuple[str, ...]]] = {"scored": ("scored",)}


__all__ = ["ExportDetails", "LoadDetails", "OverfitDetails", "RowDetails", "SaveDetails", "SteadyStepDetails"]


@dataclass(frozen=True)
class VariantDetails(RowDetails):
    """A ``variant`` row of ``pilotrun variants`` (the control's and each variant's): what it set, what it held,
    and what was measured against the control. The advisor (``estimate``, ``run``'s advice after an out-of-memory
    failure), ``select`` and ``plan`` read the measured time and memory (``estimate/measured.py``)."""

    variant: str | None                      # "control", a built-in fix (checkpointing, bf16 ...) or the user's name
    kind: str | None                         # variants.define.Kind
    settings: dict | None                    # the keys it set, as --set takes them
    what: str | None                         # what it is meant to do, in words
    experiment: str | None                   # "same experiment", or "different experiment: changes ..."
    held: list[str] | None                   # what it kept of the control (examples per update, max length)
    changed: dict | None                     # dotted key -> [control's, variant's]
    control_row: int | None                  # the control row's id (None on the control's own row)
    updates: int | None                      # updates it ran (of pilot.variants.updates)
    peak_live_bytes: int | None              # its peak of live tensor bytes over the measured updates
    peak_ratio: float | None                 # peak_live_bytes / the control's
    seconds_per_update: float | None         # median of its timed updates
    time_ratio: float | None                 # median over interleaved rounds of its seconds / the control's
    val_loss: float | None                   # after its updates
    val_loss_rel_diff: float | None          # |val - control's| / |control's|
    numerics: dict | None                    # variants.judge.Numerics
    same_initial_weights: bool | None        # its model started from the control's weights (cast to its dtype)
    error: str | None                        # why it stopped before its updates (then the verdict is fail)
    val_loss_start: float | None = None      # the validation loss at the shared initial weights
