"""``inspect``: examples exactly as the loss receives them, and counts over the whole training split.

Written once for every view (:mod:`pilotrun.gates.view`). Where the collated batch has the targets the loss reads
(``labels``), the first examples are shown token by token (supervised positions marked) and the training split is
counted as the collate produces it: fails when prompt tokens are supervised (built-in SFT), when class indices fall
outside the model's outputs or its config names the classes differently, and when more than
``max_unsupervised_share`` of the training examples have no supervised label left after truncation (any at all
warns). A framework's batch without them (a Lightning step that reads its own fields) is shown field by field.
Examples without an ``id`` warn (the resume gate could not compare which examples each update saw) unless the job
names its updates' examples by their dataset positions instead (an integration reads the indices its DataLoader
fetched: :attr:`~pilotrun.gates.view.TrainingView.update_ids`); the row then says positions, never ids.
"""
from __future__ import annotations

import torch

from ..data.audit import class_problems, render_example, scan_split
from ..ledger.records import GateName
from ..program.env import IdKind
from .base import NEEDS_INTEGRATION, Gate, GateFailure, OnProgram, Outcome, ProbeSite, Product
from .view import TrainingView, UpdateIds

NO_IDS = ("updates carry no sample ids, so the resume gate cannot compare which examples each update saw; keep "
          "each item's id in the batches")


def judge(scan: dict, label_names, class_outputs: tuple[int | None, dict | None, str],
          limit: float) -> tuple[list[str], list[str], dict]:
    """(problems that fail the gate, warnings, model class info) from a training-split scan."""
    problems, warnings, info = [], [], {}
    if scan["label_kind"] == "class":
        n_out, id2label, source = class_outputs
        info = {"outputs": n_out, "id2label": id2label, "from": source}
        problems += class_problems(scan, label_names, n_out, id2label)
    if scan["prompt_supervised_examples"]:
        problems.append(f"{scan['prompt_supervised_examples']} example(s) train on prompt tokens "
                        f"(e.g. {', '.join(scan['prompt_supervised_ids'][:5])}): prompts must be masked with -100")
    share = scan["unsupervised_share"]
    none_left = (f"{scan['unsupervised_examples']} of {scan['scanned']} training examples ({share:.1%}) have no "
                 f"supervised label left after truncation (e.g. {', '.join(scan['unsupervised_ids'][:5])})")
    if share > limit:
        problems.append(f"{none_left}: above pilot.inspect.max_unsupervised_share {limit:.0%}; raise "
                        "data.max_length or truncate prompts, not targets")
    elif scan["unsupervised_examples"]:
        warnings.append(none_left)
    return problems, warnings, info


def _has_ids(items: list) -> bool:
    return bool(items) and all(isinstance(it, dict) and it.get("id") is not None for it in items)


def _no_ids_warning(how: UpdateIds, what: str) -> str:
    """The warning for items without an id where nothing else names an update's examples either."""
    return f"{what}: {NO_IDS} (no dataset positions either: {how.how})"


def _fields(view: TrainingView, items: list, out: Outcome) -> Outcome:
    """A batch whose targets the loss picks itself: its fields and shapes, its ids."""
    batch = view.data.collate(items)
    pairs = batch.items() if hasattr(batch, "items") else enumerate(batch if isinstance(batch, (list, tuple))
                                                                     else [batch])
    shapes = {str(k): (list(v.shape), str(v.dtype).replace("torch.", "")) if isinstance(v, torch.Tensor)
              else type(v).__name__ for k, v in pairs}
    ids = [it["id"] for it in items] if _has_ids(items) else None
    how = view.update_ids
    out.details = {"fields": shapes, "ids": ids, "first_item": repr(items[0])[:500] if items else None}
    if view.targets_key is not None:
        out.warn(f"the collated batch has no '{view.targets_key}': the model must build its own targets; check that "
                 "its loss is what the long run should learn")
    if ids is None and not how.positions:
        out.warn(_no_ids_warning(how, f"the first batch ({', '.join(shapes)}) has no 'id' field"))
        return out
    if ids is None:
        # Positions, not ids: the items carry none, and the updates name their examples by where they sit.
        out.details.update(positions=list(range(len(items))), update_ids=str(IdKind.POSITION), update_ids_how=how.how)
        named = f"dataset positions {', '.join(map(str, range(min(len(items), 8))))}; the items have no 'id'"
    else:
        named = f"ids {', '.join(map(str, ids[:8]))}"
    out.reason = out.reason or (f"first batch: {len(items)} examples ({named}), fields "
                                + ", ".join(f"{k} {v}" for k, v in shapes.items()))
    return out


def _targets_of(view: TrainingView, items: list):
    if not items or view.targets_key is None:
        return None
    batch = view.data.collate(items)
    return batch.get(view.targets_key) if hasattr(batch, "get") else None


def check_inspect(view: TrainingView, out: Outcome | None = None) -> Outcome:
    """The inspect check on any view; GateFailure on a problem that makes the loss learn the wrong thing."""
    out = out or Outcome()
    shown, limit = view.inspect_limits()
    data = view.data
    items = [data.train[i] for i in range(min(max(shown, 1), len(data.train)))]
    if not view.requires_targets and not isinstance(_targets_of(view, items), torch.Tensor):
        return _fields(view, items, out)
    views = [render_example(data, it, "train", position=i) for i, it in enumerate(items[:shown])]
    scan = scan_split(data, "train", progress=view.progress, limit=view.scan_limit)
    out.details = {"examples": [{"id": v.id, "text": v.plain(), "input_tokens": v.input_tokens,
                                 "supervised": v.supervised, "padding": v.padding, "batch_keys": v.keys}
                                for v in views],
                   "scan": scan, "label_names": data.label_names}
    problems, warnings, info = judge(scan, data.label_names, view.class_outputs(), limit)
    if info:
        out.details["model_classes"] = info
    if problems:
        raise GateFailure("; ".join(problems), inputs=out.inputs, details=out.details)
    counted = (f"{scan['examples']} training examples" if scan["scanned"] == scan["examples"] else
               f"the first {scan['scanned']:,} of {scan['examples']:,} training examples")
    if scan["label_kind"] == "token":
        out.reason = (f"{counted}: supervised tokens are {scan.get('supervised_token_share', 0):.0%} of "
                      f"{scan.get('input_tokens', 0):,} input tokens; every example keeps a supervised label")
        if data.task == "causal-lm":
            out.reason += "; prompts masked"
    elif scan["label_kind"] == "class":
        dist = ", ".join(f"{k} {v}" for k, v in scan["label_distribution"].items())
        out.reason = f"{counted}; classes: {dist}"
    else:
        out.reason = f"{counted} with non-class targets"
    split = view.parameter_split()  # a dict: the adapter's split, or why it was not measured
    if split is not None:
        out.details["adapter"] = split
        if "trainable_parameters" in split:
            out.reason += (f"; adapter: {split['trainable_parameters']:,} trainable of "
                           f"{split['trainable_parameters'] + split['frozen_parameters']:,} parameters "
                           f"({split['trainable_share']:.2%})")
    for w in warnings:
        out.warn(w)
    if not _has_ids(items):
        how = view.update_ids
        if how.positions:
            out.details.update(update_ids=str(IdKind.POSITION), update_ids_how=how.how)
            out.reason += f"; the examples have no 'id': updates name theirs by {how.how}"
        else:
            out.warn(_no_ids_warning(how, "the examples have no 'id'"))
    return out


def probe(view: TrainingView, site: ProbeSite) -> Outcome:
    """The gate on a framework's view, in the program's process (``Gate.probe``)."""
    return check_inspect(view)


class InspectGate(Gate):
    name = GateName.INSPECT
    on_program = OnProgram.INTEGRATION
    probe = staticmethod(probe)
    program_note = NEEDS_INTEGRATION
    needs = (Product.DATA,)
    produces = (Product.SCAN,)
    carry = True

    def track(self, ctx):
        return []

    def recover(self, ctx, row) -> bool:
        ctx.scan = row.details.get("scan")
        return ctx.scan is not None

    def describe_inputs(self, ctx) -> dict:
        return {"seq_len": ctx.spec.data.max_length, "examples_shown": ctx.spec.pilot.inspect.examples,
                "rank": ctx.rank, "world_size": ctx.world_size}

    def run(self, ctx, meter) -> Outcome:
        try:
            out = check_inspect(ctx.view(), Outcome(inputs=self.describe_inputs(ctx)))
        except GateFailure as exc:
            ctx.scan = exc.details.get("scan")  # counted before the problem was found: the batch gate reads it
            raise
        ctx.scan = out.details.get("scan")
        return out
