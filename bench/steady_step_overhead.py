"""Pilot overhead: steady_step time per update vs a bare PyTorch loop, same model and data, one process.

    .venv/bin/python bench/steady_step_overhead.py [--rounds 5] [--updates 30]

Each round runs the real pilot (``run_pilot`` with the gates up to steady_step)
and then a bare loop a user would write (DataLoader, AdamW, accumulation with
``num_items_in_batch``, clipping, scheduler); rounds alternate so drift in
machine speed hits both. The ratio of medians is the pilot's overhead (goal
<= 1.05). Results go to bench/results/ with the machine they ran on.
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

from pilotrun.config import load_spec  # noqa: E402
from pilotrun.data.bundle import build_data  # noqa: E402
from pilotrun.models.loading import build_model, load_tokenizer  # noqa: E402
from pilotrun.pilot import PilotOptions, run_pilot  # noqa: E402
from pilotrun.train.optim import build_optimizer, build_scheduler  # noqa: E402
from pilotrun.train.sampler import DataPlan  # noqa: E402

CASES = {
    "tiny-sft (demo)": [],
    "tiny-sft x4 wider": ["model.config.hidden_size=256", "model.config.intermediate_size=704",
                          "model.config.num_hidden_layers=4", "model.config.num_attention_heads=8",
                          "model.config.num_key_value_heads=4"],
}


def bare_loop(spec, updates: int) -> float:
    """Median seconds per update of the loop a user would write by hand."""
    torch.manual_seed(spec.seed)
    tok = load_tokenizer(spec.model, spec.folder)
    data = build_data(spec.data, spec.build_context(), tok, spec.eval_max_length)
    model = build_model(spec.model, spec.build_context(), data.label_names, tok).model
    opt = build_optimizer(model, spec.train.optimizer)
    sched = build_scheduler(opt, spec.train.scheduler, spec.train.updates)
    # The same batches in the same order as the pilot (the order changes the lengths, hence the time).
    plan = DataPlan(len(data.train), spec.train.micro_batch_size, spec.train.grad_accum_steps, spec.seed)
    order = []
    for epoch in range(100):
        order += [plan.micro_batch(epoch, i) for i in range(plan.micro_batches_per_epoch)]
        if len(order) > (updates + 2) * spec.train.grad_accum_steps:
            break
    loader = torch.utils.data.DataLoader(data.train, batch_sampler=order, collate_fn=data.collate)
    it = iter(loader)
    accum = spec.train.grad_accum_steps
    times = []
    model.train()
    for _ in range(updates + 2):
        t0 = time.perf_counter()
        window = []
        for _ in range(accum):
            window.append(next(it))
        n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        for b in window:
            loss = model(**b, num_items_in_batch=torch.tensor(n)).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # as the pilot: update 1 is first_step, update 2 is the tracked one


def pilot_steady(spec, updates: int, tmp: Path) -> float:
    spec.pilot.updates = updates + 1
    opts = PilotOptions(out_dir=tmp / "out", ledger_path=tmp / "ledger.sqlite",
                        gates=["load", "first_step", "steady_step"])
    result = run_pilot(spec, opts)
    steady = next(r for r in result.rows if r["gate"] == "steady_step")
    assert steady["verdict"] in ("pass", "warn"), steady["reason"]
    return steady["details"]["median_seconds_per_update"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, overrides in CASES.items():
        pilot_t, bare_t = [], []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                spec = load_spec(REPO / "examples" / "tiny-sft" / "pilot.yaml", overrides)
                pilot_t.append(pilot_steady(spec, args.updates, Path(tmp)))
            bare_t.append(bare_loop(load_spec(REPO / "examples" / "tiny-sft" / "pilot.yaml", overrides), args.updates))
        p, b = statistics.median(pilot_t), statistics.median(bare_t)
        rows.append({"case": name, "pilot_s_per_update": p, "bare_s_per_update": b, "ratio": p / b,
                     "rounds": args.rounds, "updates_per_round": args.updates})
        print(f"{name:<20} pilot {p * 1000:8.2f} ms/update   bare {b * 1000:8.2f} ms/update   ratio {p / b:.3f}")
    write_results("steady_step_overhead", {"machine": machine(), "goal": "ratio <= 1.05", "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
