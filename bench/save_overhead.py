"""Checkpoint cost: pilotrun's atomic, hashed, fsynced save vs a plain ``torch.save`` of the same state.

    .venv/bin/python bench/save_overhead.py [--params 50e6] [--rounds 5]

Both save the same full training state (model, AdamW moments, scheduler, RNG); the
plain one is a single ``torch.save`` into the page cache, as most training scripts
do. pilotrun also hashes every byte (sha256 manifest), fsyncs each file and the
folder, and renames it into place. Rounds alternate; medians are compared (goal:
ratio <= 1.2). Results go to bench/results/ with the machine they ran on.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun.checkpoint.state import capture_rng, save_checkpoint  # noqa: E402
from pilotrun.train.optim import Schedule  # noqa: E402


class _State:
    """The attributes save_checkpoint reads from a trainer."""

    def __init__(self, n_params: int) -> None:
        width = 2048
        layers = max(1, n_params // (width * width))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.model(torch.randn(4, width)).sum().backward()
        self.optimizer.step()  # allocates both AdamW moments
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, Schedule("cosine", 10, 1000, 0.1))
        self.scaler = None
        self.step = 1

    def state(self) -> dict:
        return {"step": 1, "examples_seen": 16, "data_position": {"epoch": 0, "micro_index": 2}}


def plain(state: _State, path: Path, durable: bool = False) -> float:
    t0 = time.perf_counter()
    rng_json, rng_tensors = capture_rng()
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(), "rng": rng_tensors, "rng_json": rng_json,
                "trainer": state.state()}, path)
    if durable:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def hash_only(folder: Path) -> float:
    """sha256 of the written files alone: the floor of a hashed save on this CPU."""
    import hashlib

    t0 = time.perf_counter()
    for p in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(8 << 20), b""):
                h.update(chunk)
    return time.perf_counter() - t0


def pilot(state: _State, folder: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    written = save_checkpoint(folder, state, {"bench": True})
    return time.perf_counter() - t0, written.total_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    state = _State(int(args.params))
    n = sum(p.numel() for p in state.model.parameters())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    plain_t, durable_t, pilot_t, hash_t, size = [], [], [], [], 0

    def level() -> None:
        # Every measurement starts with no dirty pages: otherwise a write is slowed by the
        # writeback of whatever the previous one left in the page cache.
        for p in root.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        os.sync()

    try:
        for r in range(args.rounds):
            level()
            plain_t.append(plain(state, root / f"plain-{r}.pt"))
            level()
            durable_t.append(plain(state, root / f"durable-{r}.pt", durable=True))
            level()
            t, size = pilot(state, root / f"step-{r:06d}")
            pilot_t.append(t)
            hash_t.append(hash_only(root / f"step-{r:06d}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p, d, q, hs = (statistics.median(x) for x in (plain_t, durable_t, pilot_t, hash_t))
    result = {"parameters": n, "checkpoint_bytes": size, "plain_torch_save_s": p, "plain_torch_save_fsync_s": d,
              "pilotrun_save_s": q, "ratio": q / p, "ratio_vs_durable": q / d, "pilotrun_bytes_per_s": size / q,
              "plain_bytes_per_s": size / p, "rounds": args.rounds, "plain_runs_s": plain_t,
              "plain_fsync_runs_s": durable_t, "pilotrun_runs_s": pilot_t, "sha256_only_s": hs,
              "hash_threads": max(1, min(4, (os.cpu_count() or 2) - 1))}
    print(f"state {size / 2**20:.0f} MiB ({n / 1e6:.1f}M parameters + AdamW)")
    print(f"  plain torch.save           {p:.3f} s  ({size / p / 2**20:.0f} MiB/s; returns before the data is on disk)")
    print(f"  plain torch.save + fsync   {d:.3f} s  ({size / d / 2**20:.0f} MiB/s)")
    print(f"  pilotrun save              {q:.3f} s  ({size / q / 2**20:.0f} MiB/s; "
          "sha256 manifest, fsync, atomic rename)")
    print(f"  sha256 of the files alone  {hs:.3f} s  ({size / hs / 2**20:.0f} MiB/s on "
          f"{result['hash_threads']} hashing thread(s): the floor of any hashed save here)")
    print(f"  ratio vs plain {q / p:.2f} · vs plain + fsync {q / d:.2f} (goal <= 1.2)")
    write_results("save_overhead", {"machine": machine(filesystem=str(args.dir or tempfile.gettempdir())),
                                    "goal": "ratio <= 1.2", "result": result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
