"""One phase of the restore/resume proof, in a fresh process.

    python -m pilotrun.workers.train_phase --spec SPEC.json --phase control --updates 4 --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase interrupted --updates 2 --checkpoints DIR
        --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase resumed --updates 2 --checkpoints DIR
        --result R.json
    python -m pilotrun.workers.train_phase --spec SPEC.json --phase restore --checkpoint DIR --expect E.json
        --result R.json

``interrupted`` saves after its updates, prints ``SAVED``, and waits to be killed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from ..checkpoint.io import latest_checkpoint
from ..checkpoint.state import compare_fingerprints, load_state_json
from ..checkpoint.trust import LoadPolicy
from ..drivers import Driver, ModelDriver, build_job
from ..measure.meter import StageMeter
from ..train.compile import COUNT_KEYS
from .common import peak_memory, read_spec_file, write_error, write_result


def _float(x: float | None) -> str | None:
    return None if x is None else (float(x).hex() if math.isfinite(x) else repr(x))


def record(rec) -> dict:
    # train.compile: what the update compiled in this fresh process (the resume gate reports the resumed compile)
    compiled = {k: rec.extra[k] for k in COUNT_KEYS if k in rec.extra}
    return {"step": rec.step, "sample_ids": rec.sample_ids, "lr": _float(rec.lr), "loss": _float(rec.loss),
            "grad_norm": _float(rec.grad_norm), **compiled}


def run_updates(driver: Driver, n: int) -> list[dict]:
    return [record(driver.update()) for _ in range(n)]


def restore_check(driver: Driver, folder: Path, expect: dict | Path, known, trust: bool = False,
                  expect_sha256: str | None = None) -> dict:
    """Admit ``folder`` under the loading policy, restore it into ``driver`` and compare its live state with what
    the saving process recorded (``expect``: the fingerprints, or the file holding them, whose bytes must hash to
    ``expect_sha256`` when the save recorded it)."""
    LoadPolicy.of(known, trust).admit(folder)
    driver.restore(folder)
    actual = driver.fingerprint()
    if isinstance(expect, Path):
        # Beside the checkpoint, outside its manifest: the bytes the save recorded, then field by field against
        # this process's own.
        expect = load_state_json(expect, actual, expect_sha256)
    sync = expect.get("buffer_sync") or {}
    return {"mismatches": compare_fingerprints(expect, actual), "step": actual["step"], "lr": actual["lr"],
            "buffer_sync": {"source_rank": sync.get("source_rank"), "why": sync.get("why")} if sync else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.train_phase")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--phase", required=True, choices=["control", "interrupted", "resumed", "restore"])
    ap.add_argument("--updates", type=int, default=0)
    ap.add_argument("--checkpoints", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--expect", help="fingerprints saved with the checkpoint; {rank} is replaced per rank")
    ap.add_argument("--expect-sha256", help="each rank's expect file's sha256 as the save wrote it, comma-separated")
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    env = None
    try:
        from .. import distributed

        spec = read_spec_file(args.spec)
        driver = build_job(spec)
        env, device = driver.env, driver.device
        payload: dict = {"phase": args.phase, "world_size": env.world_size}
        if args.phase == "control":
            payload["records"] = run_updates(driver, args.updates)
        elif args.phase == "interrupted":
            payload["records"] = run_updates(driver, args.updates)
            folder = args.checkpoints / f"step-{driver.step:06d}"
            payload["manifest_sha256"] = driver.save(folder)["manifest_sha256"]  # of the bytes written
            payload["checkpoint"] = str(folder)
        elif args.phase == "resumed":
            folder = latest_checkpoint(args.checkpoints)
            if folder is None:
                raise RuntimeError(f"no complete checkpoint under {args.checkpoints}")
            LoadPolicy.of(args.known_manifest).admit(folder)
            state = driver.restore(folder)
            payload["restored_from"] = str(folder)
            payload["restored_step"] = state["step"]
            payload["records"] = run_updates(driver, args.updates)
        else:
            expect = Path(args.expect.replace("{rank}", str(env.rank)))
            digests = args.expect_sha256.split(",") if args.expect_sha256 else []
            digest = digests[env.rank] if env.rank < len(digests) else None
            track = [driver.plain_model, driver.optimizer] if isinstance(driver, ModelDriver) else []
            with StageMeter(device, track=track) as meter:
                payload.update(restore_check(driver, args.checkpoint, expect, args.known_manifest,
                                             expect_sha256=digest))
            payload["memory"] = meter.memory
            payload["seconds"] = meter.seconds
        payload["peak"] = peak_memory(device)
        driver.close()
        if args.phase != "interrupted":
            del driver  # the DDP/FSDP model goes before the process group (see distributed.shutdown)
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
            write_error(args.result, exc, phase=args.phase)
        return 1


if __name__ == "__main__":
    from ..procs import quiet_import_noise

    quiet_import_noise()  # torchao's import warnings (through transformers') are not this job's
    sys.exit(main())
