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


def restore_check(trainer, folder: Path, expect: dict, known: set[str] | None, trust: bool = False) -> dict:
    """Restore into ``trainer`` and compare its live state with what the saving process recorded."""
    check_trusted(folder, known, trust)
    restore_training_state(trainer, folder)
    actual = fingerprint_state(trainer)
    return {"mismatches": compare_fingerprints(expect, actual), "step": actual["step"], "lr": actual["lr"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.train_phase")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--phase", required=True, choices=["control", "interrupted", "resumed", "restore"])
    ap.add_argument("--updates", type=int, default=0)
    ap.add_argument("--checkpoints", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--expect", type=Path)
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    try:
        spec = read_spec_file(args.spec)
        trainer, data, device = build_trainer(spec)
        payload: dict = {"phase": args.phase}
        if args.phase == "control":
            payload["records"] = run_updates(trainer, args.updates)
        elif args.phase == "interrupted":
            payload["records"] = run_updates(trainer, args.updates)
            folder = args.checkpoints / f"step-{trainer.step:06d}"
            save_checkpoint(folder, trainer, spec.canonical(), spec.config_hash())
            payload["checkpoint"] = str(folder)
        elif args.phase == "resumed":
            folder = latest_checkpoint(args.checkpoints)
            if folder is None:
                raise RuntimeError(f"no complete checkpoint under {args.checkpoints}")
            check_trusted(folder, set(args.known_manifest) or None, trust=False)
            state = restore_training_state(trainer, folder)
            payload["restored_from"] = str(folder)
            payload["restored_step"] = state["step"]
            payload["records"] = run_updates(trainer, args.updates)
        else:
            expect = json.loads(args.expect.read_text())
            with StageMeter(device, track=[trainer.model, trainer.optimizer]) as meter:
                payload.update(restore_check(trainer, args.checkpoint, expect, set(args.known_manifest) or None))
            payload["memory"] = meter.memory
            payload["seconds"] = meter.seconds
        payload["peak"] = peak_memory(device)
        trainer.close()
        write_result(args.result, payload)
        if args.phase == "interrupted":
            print("SAVED", flush=True)
            while True:  # the parent kills this process: nothing after the checkpoint may matter
                time.sleep(60)
        return 0
    except Exception as exc:  # reported to the gate, which names it in its row
        write_result(args.result, {"phase": args.phase, "error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()[-4000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
