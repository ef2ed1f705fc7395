"""What ``job.stage(..., track=[model, opt])`` around every update costs a program on CPU.

    .venv/bin/python bench/stage_overhead.py [--rounds 15] [--updates 10] [--width 512] [--depth 8]

The handle's documented loop (and the Trainer and Lightning callbacks) enters a stage once per
update. On CPU a stage's peak allocated memory comes from a live-tensor tracker that sees every
tensor op, which slowed a Lightning step from 2.6 s to 4.5 s; a session now tracks at most one
update per stage name (the first) and only times the rest. Three arms, the same model, optimizer
and batches, interleaved update by update (the order rotates) so drift in machine speed hits all:

- ``bare``: the update alone;
- ``stage``: each update inside ``job.stage("steady_step", track=[model, opt])`` of an active
  handle (events written to a temporary folder, as in a pilot's run);
- ``tracked every update``: each update inside a ``StageMeter`` that tracks tensors for the
  whole stage, what every stage did before (for scale; not the goal).

The ratio of medians ``stage / bare`` is the overhead (goal <= 1.05). Results go to
bench/results/ with the machine they ran on.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun.measure.meter import StageMeter  # noqa: E402
from pilotrun.program import env as E  # noqa: E402
from pilotrun.program.handle import ProgramHandle  # noqa: E402


def build(width: int, depth: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    return model, opt, x, y


def update(model, opt, x, y) -> float:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def handle(folder: Path) -> ProgramHandle:
    return ProgramHandle(environ={E.PROGRAM: "1", E.ROLE: "control", E.RUN_ID: "bench",
                                  E.EVENTS: str(folder / "events"), E.CHECKPOINT_DIR: str(folder / "ckpt")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--updates", type=int, default=10, help="timed updates per arm and round (interleaved)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    model, opt, x, y = build(args.width, args.depth, args.batch)
    cpu = torch.device("cpu")
    times: dict[str, list[float]] = {"bare": [], "stage": [], "tracked every update": []}
    with tempfile.TemporaryDirectory() as tmp:
        job = handle(Path(tmp))
        with job.stage("first_step", track=[model, opt]):  # the optimizer state exists from here on
            update(model, opt, x, y)
        with job.stage("steady_step", track=[model, opt]):  # the one tracked steady update
            update(model, opt, x, y)

        def bare() -> None:
            update(model, opt, x, y)

        def staged() -> None:
            with job.stage("steady_step", track=[model, opt]):
                update(model, opt, x, y)

        def tracked() -> None:
            with StageMeter(cpu, track=[model, opt], tensor_tracking="stage"):
                update(model, opt, x, y)

        arms = [("bare", bare), ("stage", staged), ("tracked every update", tracked)]
        for _ in range(2):  # warm-up, untimed
            for _, fn in arms:
                fn()
        # One update of each arm in turn, the order rotating: drift in machine speed (other work on the machine)
        # lands on every arm alike.
        for r in range(args.rounds * args.updates):
            for name, fn in arms[r % 3:] + arms[:r % 3]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        stage_rows = sum(1 for line in job.events_path.read_text().splitlines() if '"kind": "stage"' in line)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["stage"] / med["bare"]
    old = med["tracked every update"] / med["bare"]
    params = sum(p.numel() for p in model.parameters())
    for name, t in med.items():
        print(f"{name:<22} {t * 1000:8.2f} ms/update (median of {len(times[name])})")
    print(f"stage / bare = {ratio:.3f} (goal <= 1.05); tracked every update / bare = {old:.3f}")
    write_results("stage_overhead", {
        "machine": machine(), "goal": "stage / bare <= 1.05",
        "setup": {"model": f"MLP {args.depth} x {args.width} ({params:,} parameters), AdamW, clipping",
                  "batch": args.batch, "rounds": args.rounds, "updates_per_arm_and_round": args.updates,
                  "stage_rows_written": stage_rows},
        "median_seconds_per_update": med, "ratio_stage_over_bare": ratio,
        "ratio_tracked_every_update_over_bare": old}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
