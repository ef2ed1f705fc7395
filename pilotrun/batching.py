"""Examples-per-update arithmetic (docs/architecture.md, "Contracts": examples per update): a function from sizes to
numbers, no terminal, no GPU.

    >>> plan = batch_plan(micro_batch_size=2, grad_accum_steps=8, replicas=1, examples=3200)
    >>> plan["examples_per_update"], plan["updates_per_epoch"], plan["last_window"]
    (16, 200, None)

Data replicas (DDP/FSDP ranks that see different examples) multiply the batch;
model parallelism (tensor/pipeline ranks that share one batch) does not.
"""
from __future__ import annotations

import math


def batch_plan(micro_batch_size: int, grad_accum_steps: int, replicas: int, examples: int, drop_last: bool = False,
               model_parallel: int = 1, tokens_per_example: float | None = None,
               passes_num_items: bool | None = None, micro_steps: int | None = None) -> dict:
    """``micro_steps``: the loader's own count of micro batches per epoch and process, where the framework has one (a
    batch sampler, a distributed sampler); else it follows from the sizes."""
    if min(micro_batch_size, grad_accum_steps, replicas, model_parallel) < 1 or examples < 0:
        raise ValueError("micro batch, accumulation, replicas and model parallelism must be at least 1")
    per_micro_step = micro_batch_size * replicas
    per_update = per_micro_step * grad_accum_steps
    if micro_steps is None:
        micro_steps = examples // per_micro_step if drop_last else math.ceil(examples / per_micro_step)
    updates = math.ceil(micro_steps / grad_accum_steps)
    dropped = examples - micro_steps * per_micro_step if drop_last else 0
    plan: dict = {
        "micro_batch_size": micro_batch_size,
        "grad_accum_steps": grad_accum_steps,
        "replicas": replicas,
        "model_parallel": model_parallel,
        "examples": examples,
        "drop_last": drop_last,
        "examples_per_update": per_update,
        "micro_steps_per_epoch": micro_steps,
        "updates_per_epoch": updates,
        "examples_dropped_per_epoch": dropped,
        "last_window": None,
        "notes": [],
    }
    used = micro_steps * per_micro_step if drop_last else examples
    last_examples = used - (updates - 1) * per_update if updates else 0
    if updates and last_examples != per_update:
        last_micro = micro_steps - (updates - 1) * grad_accum_steps
        short_micro = used - (micro_steps - 1) * per_micro_step
        plan["last_window"] = {
            "examples": last_examples,
            "micro_steps": last_micro,
            "last_micro_step_examples": short_micro,  # across all replicas
            "share_of_full": last_examples / per_update,
            "normalisation": _normalisation(passes_num_items),
        }
    if tokens_per_example is not None:
        plan["tokens_per_update"] = tokens_per_example * per_update
    if model_parallel > 1:
        plan["notes"].append(
            f"model parallelism ({model_parallel}) splits the model, not the data: it does not multiply the "
            f"examples per update; {replicas} data replica(s) do"
        )
    if dropped:
        plan["notes"].append(f"drop_last drops {dropped} example(s) every epoch")
    return plan


def _normalisation(passes_num_items: bool | None) -> str:
    if passes_num_items is True:
        return ("num_items_in_batch counts the short window's own supervised labels: its loss is a mean over them, "
                "not scaled as if the window were full")
    if passes_num_items is False:
        return ("each micro batch's loss is weighted by its share of the window's examples: the short window is "
                "a mean over its own examples, not scaled as if it were full")
    return ("a mean over the short window's own examples (pilotrun's loop); a loop that divides by grad_accum_steps "
            "scales it down")


def compare(base: dict, other: dict, fix: str) -> dict:
    """Change the batch and hold ``fix`` ("updates" or "epochs"): what moves, and by how much."""
    if fix not in ("updates", "epochs"):
        raise ValueError("fix must be 'updates' or 'epochs'")
    a, b = base["examples_per_update"], other["examples_per_update"]
    if fix == "updates":
        return {
            "held": "updates",
            "moves": "examples seen",
            "ratio": b / a,
            "text": (f"holding the number of updates, {b} examples per update instead of {a} shows "
                     f"{b / a:.3g}x the examples ({b / a:.3g}x the epochs)"),
        }
    ua, ub = base["updates_per_epoch"], other["updates_per_epoch"]
    return {
        "held": "epochs",
        "moves": "updates",
        "ratio": ub / ua if ua else math.inf,
        "text": (f"holding the number of epochs, {b} examples per update instead of {a} makes {ub} updates per epoch "
                 f"instead of {ua} ({ub / ua if ua else math.inf:.3g}x): the schedule and the number of optimizer "
                 "steps change"),
    }
