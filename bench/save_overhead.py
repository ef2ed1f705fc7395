"""Checkpoint cost: pilotrun's atomic, hashed, fsynced save vs a plain ``torch.save`` of the same state.

    .venv/bin/python bench/save_overhead.py [--params 50e6] [--rounds 5]

All save the same full training state (model, AdamW moments, scheduler, RNG). The plain one is a single
``torch.save`` into the page cache, as most training scripts do; the durable one adds an fsync. pilotrun hashes every
byte as it writes it (the checkpoint digest, and sha256 for comparison), fsyncs each file and the folder, and renames
it into place; its background save (``start_checkpoint``) is timed twice: what the job waits (the host copy) and the
whole save until the folder is in place. Rounds alternate; medians are compared. Three ratios: pilotrun's save vs
plain, vs durable (goal <= 1.1), and the background save's blocking time vs durable. Results go to bench/results/
with the machine they ran on.
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

from pilotrun.checkpoint.digest import CHECKPOINT_DIGEST, Digest, hasher  # noqa: E402
from pilotrun.checkpoint.saving import save_checkpoint, start_checkpoint  # noqa: E402
from pilotrun.checkpoint.state import capture_rng  # noqa: E402
from pilotrun.checkpoint.writer import writer_threads  # noqa: E402
from pilotrun.train.optim import Schedule  # noqa: E402


class _State:
    """The attributes save_checkpoint reads from a trainer."""

    def __init__(self, n_params: int, device: torch.device) -> None:
        width = 2048
        layers = max(1, n_params // (width * width))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.model(torch.randn(4, width, device=device)).sum().backward()
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


def hash_only(folder: Path, algo: Digest) -> float:
    """The digest of the written files alone, one file after another on one thread."""
    t0 = time.perf_counter()
    for p in sorted(folder.iterdir()):
        h = hasher(algo)
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(8 << 20), b""):
                h.update(chunk)
    return time.perf_counter() - t0


def pilot(state: _State, folder: Path, algo: Digest) -> tuple[float, int]:
    t0 = time.perf_counter()
    written = save_checkpoint(folder, state, {"bench": True}, digest=algo)
    return time.perf_counter() - t0, written.total_bytes


def background(state: _State, folder: Path) -> tuple[float, float]:
    """(what the job waited, the whole save until the folder is in place)."""
    pending = start_checkpoint(folder, state, {"bench": True})
    pending.wait()
    assert pending.total_seconds is not None
    return pending.blocking_seconds, pending.total_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--device", default="cpu", help="where the state lives (cuda: the blocking time is the copy off "
                    "the device into pinned host memory)")
    args = ap.parse_args()
    state = _State(int(args.params), torch.device(args.device))
    n = sum(p.numel() for p in state.model.parameters())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    other = Digest.SHA256 if CHECKPOINT_DIGEST is not Digest.SHA256 else Digest.BLAKE3
    runs: dict[str, list[float]] = {k: [] for k in ("plain", "durable", "pilot", "pilot_other", "blocking",
                                                     "background_total", "hash", "hash_other")}
    size = 0

    def level() -> None:
        # Every measurement starts with no dirty pages: otherwise a write is slowed by the
        # writeback of whatever the previous one left in the page cache.
        for p in root.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        os.sync()

    try:
        for r in range(args.rounds):
            level()
            runs["plain"].append(plain(state, root / f"plain-{r}.pt"))
            level()
            runs["durable"].append(plain(state, root / f"durable-{r}.pt", durable=True))
            level()
            t, size = pilot(state, root / f"step-{r:06d}", CHECKPOINT_DIGEST)
            runs["pilot"].append(t)
            runs["hash"].append(hash_only(root / f"step-{r:06d}", CHECKPOINT_DIGEST))
            runs["hash_other"].append(hash_only(root / f"step-{r:06d}", other))
            level()
            runs["pilot_other"].append(pilot(state, root / f"other-{r:06d}", other)[0])
            level()
            blocking, total = background(state, root / f"background-{r:06d}")
            runs["blocking"].append(blocking)
            runs["background_total"].append(total)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    p, d, q = med["plain"], med["durable"], med["pilot"]
    result = {"parameters": n, "checkpoint_bytes": size, "state_device": args.device, "digest": CHECKPOINT_DIGEST.value,
              "writer_threads": writer_threads(), "plain_torch_save_s": p, "plain_torch_save_fsync_s": d,
              "pilotrun_save_s": q, f"pilotrun_save_{other.value}_s": med["pilot_other"],
              "background_blocking_s": med["blocking"], "background_total_s": med["background_total"],
              "ratio": q / p, "ratio_vs_durable": q / d, "blocking_vs_durable": med["blocking"] / d,
              f"{CHECKPOINT_DIGEST.value}_only_s": med["hash"], f"{other.value}_only_s": med["hash_other"],
              "pilotrun_bytes_per_s": size / q, "plain_bytes_per_s": size / p, "rounds": args.rounds,
              "runs_s": runs}
    mib = size / 2**20
    print(f"state {mib:.0f} MiB ({n / 1e6:.1f}M parameters + AdamW), {result['writer_threads']} writer thread(s)")
    print(f"  plain torch.save              {p:.3f} s  ({mib / p:.0f} MiB/s; returns before the data is on disk)")
    print(f"  plain torch.save + fsync      {d:.3f} s  ({mib / d:.0f} MiB/s)")
    print(f"  pilotrun save ({CHECKPOINT_DIGEST.value})         {q:.3f} s  ({mib / q:.0f} MiB/s; hashed while written, "
          "fsync, atomic rename)")
    print(f"  pilotrun save ({other.value})         {med['pilot_other']:.3f} s  (the other digest, for the choice)")
    print(f"  background save: job waits    {med['blocking']:.3f} s  (the host copy); whole save "
          f"{med['background_total']:.3f} s")
    print(f"  {CHECKPOINT_DIGEST.value} of the files alone      {med['hash']:.3f} s · {other.value} "
          f"{med['hash_other']:.3f} s (one thread, read back)")
    print(f"  ratios: vs plain {q / p:.2f} · vs plain + fsync {q / d:.2f} (goal <= 1.1) · background blocking vs "
          f"plain + fsync {med['blocking'] / d:.2f}")
    write_results("save_overhead", {"machine": machine(filesystem=str(args.dir or tempfile.gettempdir())),
                                    "goal": "pilotrun save <= 1.1 x torch.save + fsync", "result": result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
