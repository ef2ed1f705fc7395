"""What to change when a stage does not fit, in the fix order of docs/architecture.md ("Contracts"), each
variant with its predicted memory and time.

1. smaller micro batch, more accumulation (examples per update held: the same experiment);
2. activation checkpointing (memory saved vs time added, both predicted);
3. mixed precision (bf16, or fp16 with a grad scaler stepped on the real update boundary);
4. sharding with FSDP2 across GPUs;
5. a larger accelerator.

Cutting the maximum length is never proposed: it changes the question, not the cost.
"""
from __future__ import annotations

from .catalog import Accelerator
from .model import estimate_fit


def _row(name: str, fit: dict, base_s: float | None, changes: dict, experiment: str, why: str) -> dict:
    s = fit["seconds_per_update"]
    return {
        "variant": name, "changes": changes, "experiment": experiment, "reason": why,
        "accelerator": fit["accelerator"], "strategy": fit["strategy"], "gpus": fit["gpus"],
        "device_used_bytes": fit["device_used_bytes"], "peak_allocated_bytes": fit["peak_allocated_bytes"],
        "capacity_bytes": fit["capacity_bytes"], "fits": fit["fits"], "seconds_per_update": s,
        "time_factor": (s / base_s) if s and base_s else None,
    }


def advise(spec, traces, acc: Accelerator, strategy: str, gpus: int, catalog: dict[str, Accelerator],
           utilisation: float | None = None) -> list[dict]:
    """Variants for ``spec`` on ``acc`` (as ``strategy`` over ``gpus``); the first that fits is the advice."""
    t = spec.train
    base = traces.get()
    current = estimate_fit(base, acc, strategy, gpus, utilisation=utilisation)
    base_s = current["seconds_per_update"]
    out = []
    # 1. smaller micro batch with more accumulation: activations shrink, examples per update held.
    mb, accum = t.micro_batch_size, t.grad_accum_steps
    cand = mb // 2
    while cand >= 1:
        fit = estimate_fit(base, acc, strategy, gpus, utilisation=utilisation, micro_scale=cand / mb)
        new_accum = accum * mb // cand
        if (mb * accum) % cand == 0:
            out.append(_row("smaller micro batch, more accumulation", fit, base_s,
                            {"train.micro_batch_size": cand, "train.grad_accum_steps": new_accum},
                            "same experiment: examples per update held",
                            f"{cand} x {new_accum} = {cand * new_accum} examples per update, as before; activations "
                            f"scale with the micro batch (linear model from the trace)"))
            if fit["fits"]:
                break
        cand //= 2
    # 2. activation checkpointing: a second trace.
    if not t.activation_checkpointing:
        ac = traces.get(ac=True)
        fit = estimate_fit(ac, acc, strategy, gpus, utilisation=utilisation)
        saved = current["device_used_bytes"] - fit["device_used_bytes"]
        out.append(_row("activation checkpointing", fit, base_s, {"train.activation_checkpointing": True},
                        "same experiment: the same function, recomputed",
                        f"saves {saved / 2**30:.1f} GiB; the forward is recomputed in backward "
                        f"({ac['stages']['steady_step']['flops'] / base['stages']['steady_step']['flops']:.2f}x "
                        "FLOPs)"))
    # 3. mixed precision.
    if t.precision == "fp32":
        half = traces.get(precision="bf16")
        fit = estimate_fit(half, acc, strategy, gpus, utilisation=utilisation)
        out.append(_row("mixed precision (bf16)", fit, base_s, {"train.precision": "bf16"},
                        "a variant: numerics change, record it as its own experiment",
                        "bf16 autocast with fp32 master weights; on hardware without bf16, fp16 with a grad scaler "
                        "stepped once per update"))
    # 4. sharding, then sharding with activation checkpointing.
    per_node = int(acc.interconnect.get("gpus_per_node", 8))
    sharded_fits = False
    for n in (2, 4, 8, 16):
        if n > per_node * 2 or (strategy == "fsdp" and n <= gpus):
            continue
        fit = estimate_fit(base, acc, "fsdp", n, utilisation=utilisation)
        out.append(_row(f"FSDP2 over {n} GPUs", fit, base_s, {"distributed.strategy": "fsdp", "gpus": n},
                        "same experiment if examples per update are held (accumulation divided by the replicas)",
                        "parameters, gradients and optimizer state sharded; activations per rank unchanged"))
        if fit["fits"]:
            sharded_fits = True
            break
    if not sharded_fits and not t.activation_checkpointing:
        ac = traces.get(ac=True)
        for n in (2, 4, 8):
            fit = estimate_fit(ac, acc, "fsdp", n, utilisation=utilisation)
            out.append(_row(f"FSDP2 over {n} GPUs + activation checkpointing", fit, base_s,
                            {"distributed.strategy": "fsdp", "gpus": n, "train.activation_checkpointing": True},
                            "same experiment if examples per update are held", "both savings at once"))
            if fit["fits"]:
                break
    # 5. a larger accelerator: meaningfully larger (10% or more), not a rounding of the same class.
    for other in sorted(catalog.values(), key=lambda a: a.memory_bytes):
        if other.memory_bytes < acc.memory_bytes * 1.10:
            continue
        fit = estimate_fit(base, other, strategy, gpus, utilisation=None)
        out.append(_row(f"a larger accelerator ({other.name})", fit, base_s, {"accelerator": other.name},
                        "same experiment", f"{other.memory_bytes / 2**30:.0f} GiB per device"))
        if fit["fits"]:
            break
    return out
