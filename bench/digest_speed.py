"""How fast each file digest a manifest may record runs on this machine: what the checkpoint's choice rests on.

    .venv/bin/python bench/digest_speed.py [--mib 256] [--rounds 5]

Hashes one in-memory buffer (no disk): sha256 (hashlib, OpenSSL) and BLAKE3 (the ``blake3`` package) on one
thread, BLAKE3 with its own threads (``max_threads=AUTO``), and each on as many threads as the save's writer pool
runs at once (one buffer per thread: how shards are hashed while they are written). Medians of the rounds;
results go to bench/results/ with the machine.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun.checkpoint.writer import writer_threads  # noqa: E402

KINDS = {
    "sha256": lambda b: hashlib.sha256(b).hexdigest(),
    "blake3": lambda b: blake3.blake3(b).hexdigest(),
    "blake3_auto_threads": lambda b: blake3.blake3(b, max_threads=blake3.blake3.AUTO).hexdigest(),
}


def timed(fn, rounds: int) -> float:
    runs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    buf = memoryview(os.urandom(args.mib << 20))
    threads = writer_threads()
    result: dict = {"buffer_bytes": buf.nbytes, "rounds": args.rounds, "writer_threads": threads}
    print(f"{args.mib} MiB in memory, {args.rounds} rounds (medians)")
    for name, fn in KINDS.items():
        one = timed(lambda fn=fn: fn(buf), args.rounds)
        with ThreadPoolExecutor(threads) as pool:
            many = timed(lambda fn=fn: list(pool.map(fn, [buf] * threads)), args.rounds)
        result[name] = {"one_buffer_bytes_per_s": buf.nbytes / one,
                        "parallel_bytes_per_s": threads * buf.nbytes / many}
        print(f"  {name:20s} {buf.nbytes / one / 1e9:5.2f} GB/s one buffer · "
              f"{threads * buf.nbytes / many / 1e9:5.2f} GB/s over {threads} thread(s)")
    write_results("digest_speed", {"machine": machine(), "result": result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
