"""``pilotrun batch``: examples per update, updates per epoch, the last partial window; what moves when the
batch changes."""
from __future__ import annotations

import json

from ..batching import batch_plan, compare
from .common import UsageError, command_parser, out_console

HELP = """examples:
  pilotrun batch --micro-batch 2 --grad-accum 8 --replicas 1 --examples 3200
  pilotrun batch --micro-batch 2 --grad-accum 8 --replicas 1 --examples 3210 --drop-last
  pilotrun batch --micro-batch 2 --grad-accum 8 --replicas 4 --model-parallel 2 --examples 3200
  pilotrun batch --micro-batch 2 --grad-accum 8 --examples 3200 --vs micro-batch=4   # what moves
  pilotrun batch ... --json"""


def add_parser(sub) -> None:
    p = command_parser(sub, "batch", __doc__, HELP)
    p.add_argument("--micro-batch", type=int, required=True, help="examples per forward/backward per replica")
    p.add_argument("--grad-accum", type=int, default=1, help="micro batches per update")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel ranks (DDP/FSDP) that see different examples")
    p.add_argument("--model-parallel", type=int, default=1,
                   help="tensor/pipeline ranks sharing one batch (do not multiply it)")
    p.add_argument("--examples", type=int, required=True, help="training examples per epoch")
    p.add_argument("--drop-last", action="store_true", help="drop each epoch's last partial micro step")
    p.add_argument("--tokens-per-example", type=float, help="mean tokens per example, for tokens per update")
    p.add_argument("--vs", action="append", default=[], metavar="KEY=VALUE",
                   help="compare with another batch: micro-batch=4, grad-accum=16 or replicas=8 (repeatable)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


KEYS = {"micro-batch": "micro_batch_size", "grad-accum": "grad_accum_steps", "replicas": "replicas"}


def main(args) -> int:
    base_args = dict(micro_batch_size=args.micro_batch, grad_accum_steps=args.grad_accum, replicas=args.replicas,
                     examples=args.examples, drop_last=args.drop_last, model_parallel=args.model_parallel,
                     tokens_per_example=args.tokens_per_example)
    try:
        base = batch_plan(**base_args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    comparisons = []
    for item in args.vs:
        key, _, value = item.partition("=")
        if key not in KEYS or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--vs {item!r}: expected micro-batch=N, grad-accum=N or replicas=N")
        other = batch_plan(**{**base_args, KEYS[key]: int(value)})
        comparisons.append({"vs": item, "plan": other, "fix_updates": compare(base, other, "updates"),
                            "fix_epochs": compare(base, other, "epochs")})
    if args.json:
        print(json.dumps({"plan": base, "comparisons": comparisons}, indent=1))
        return 0
    c = out_console()
    c.print(f"[bold]{args.micro_batch}[/] examples per micro batch × [bold]{args.grad_accum}[/] accumulation × "
            f"[bold]{args.replicas}[/] data replica(s) = [bold green]{base['examples_per_update']}[/] "
            "examples per update")
    c.print(f"{args.examples} examples → [bold green]{base['updates_per_epoch']}[/] updates per epoch "
            f"({base['micro_steps_per_epoch']} micro steps)")
    if base.get("tokens_per_update"):
        c.print(f"≈ {base['tokens_per_update']:,.0f} tokens per update")
    last = base["last_window"]
    if last:
        c.print(f"last window of each epoch: {last['examples']} examples in {last['micro_steps']} micro step(s) "
                f"({last['share_of_full']:.0%} of a full update); {last['normalisation']}")
    else:
        c.print("no partial window: every update is full")
    for note in base["notes"]:
        c.print(f"[yellow]note:[/] {note}")
    for comp in comparisons:
        c.print(f"\n[bold]vs {comp['vs']}[/] ({comp['plan']['examples_per_update']} examples per update):")
        c.print(f"  {comp['fix_updates']['text']}")
        c.print(f"  {comp['fix_epochs']['text']}")
    return 0
