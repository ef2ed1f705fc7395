"""One phase of the restore/resume proof, in a fresh process.

    python -m pilotrun.workers.train_phase --spec SPEC.json --phase control --updates 4 --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase interrupted --updates 2 --checkpoints DIR --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase resumed --updates 2 --checkpoints DIR --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase restore --checkpoint DIR --expect E.json --result R.json

``interrupted`` saves after its updates, prints ``SAVED``, and waits to be killed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

from ..checkpoint.io import latest_checkpoint
from ..checkpoint.state import (
    check_trusted,
    compare_fingerprints,
    fingerprint_state,
    restore_training_state,
    save_checkpoint,
)
from ..measure.meter import StageMeter
from .common import build_trainer, peak_memory, read_spec_file, write_result


def _float(x: float | None) -> str | None:
    return None if x is None else (float(x).hex() if math.isfinite(x) else repr(x))


def record(rec) -> dict:
    return {"step": rec.step, "sample_ids": rec.sample_ids, "lr": _float(rec.lr), "loss": _float(rec.loss),
            "grad_norm": _float(rec.grad_norm)}


def run_updates(trainer, n: int) -> list[dict]:
    return [record(trainer.update()) for _ in range(n)]


def restore_any(trainer, folder: Path) -> dict:
    """A single-process checkpoint, or a distributed (DCP) one into this process group."""
    from ..checkpoint.dist import is_distributed_checkpoint, restore_distributed

    if is_distributed_checkpoint(folder):
        return restore_distributed(trainer, folder, trainer.env)
    return restore_training_state(trainer, folder)


def restore_check(trainer, folder: Path, expect: dict, known: set[str] | None, trust: bool = False) -> dict:
    """Restore into ``trainer`` and compare its live state with what the saving process recorded."""
    check_trusted(folder, known, trust)
    restore_any(trainer, folder)
    actual = fingerprint_state(trainer)
    return {"mismatches": compare_fingerprints(expect, actual), "step": actual["step"], "lr": actual["lr"]}


def save_any(trainer, folder: Path, spec) -> None:
    from ..checkpoint.dist import save_distributed

    if trainer.env.active:
        save_distributed(folder, trainer, spec.canonical(), trainer.env, spec.config_hash())
    else:
        save_checkpoint(folder, trainer, spec.canonical(), spec.config_hash())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.train_phase")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--phase", required=True, choices=["control", "interrupted", "resumed", "restore"])
    ap.add_argument("--updates", type=int, default=0)
    ap.add_argument("--checkpoints", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--expect", help="fingerprints saved with the checkpoint; {rank} is replaced per rank")
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    env = None
    try:
        from .. import distributed

        spec = read_spec_file(args.spec)
        trainer, data, device = build_trainer(spec)
        env = trainer.env
        payload: dict = {"phase": args.phase, "world_size": env.world_size}
        if args.phase == "control":
            payload["records"] = run_updates(trainer, args.updates)
        elif args.phase == "interrupted":
            payload["records"] = run_updates(trainer, args.updates)
            folder = args.checkpoints / f"step-{trainer.step:06d}"
            save_any(trainer, folder, spec)
            payload["checkpoint"] = str(folder)
        elif args.phase == "resumed":
            folder = latest_checkpoint(args.checkpoints)
            if folder is None:
                raise RuntimeError(f"no complete checkpoint under {args.checkpoints}")
            check_trusted(folder, set(args.known_manifest) or None, trust=False)
            state = restore_any(trainer, folder)
            payload["restored_from"] = str(folder)
            payload["restored_step"] = state["step"]
            payload["records"] = run_updates(trainer, args.updates)
        else:
            expect = json.loads(Path(args.expect.replace("{rank}", str(env.rank))).read_text())
            with StageMeter(device, track=[trainer.model, trainer.optimizer]) as meter:
                payload.update(restore_check(trainer, args.checkpoint, expect, set(args.known_manifest) or None))
            payload["memory"] = meter.memory
            payload["seconds"] = meter.seconds
        payload["peak"] = peak_memory(device)
        trainer.close()
        if args.phase != "interrupted":
            del trainer  # the DDP/FSDP model goes before the process group (see distributed.shutdown)
        per_rank = distributed.gather(env, payload)
        if env.is_main:
            combined = dict(per_rank[0])
            if args.phase == "restore":
                combined["mismatches"] = [dict(m, rank=i) for i, p in enumerate(per_rank) for m in p["mismatches"]]
                combined["peak_by_rank"] = [p.get("peak") for p in per_rank]
            if "records" in combined:
                combined["records_by_rank"] = [p["records"] for p in per_rank]
            write_result(args.result, combined)
        if args.phase == "interrupted":
            distributed.barrier(env)
            if env.is_main:
                print("SAVED", flush=True)
            while True:  # the parent kills this process: nothing after the checkpoint may matter
                time.sleep(60)
        distributed.shutdown(env)
        return 0
    except Exception as exc:  # reported to the gate, which names it in its row
        if env is None or env.is_main:
            write_result(args.result, {"phase": args.phase, "error": f"{type(exc).__name__}: {exc}",
                                       "traceback": traceback.format_exc()[-4000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
