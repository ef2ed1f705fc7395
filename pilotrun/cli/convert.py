"""``pilotrun convert CHECKPOINT --out FILE``: a distributed checkpoint as one file, no processes needed.

The result loads in a plain script: ``torch.load(FILE, weights_only=True)`` for ``.pt`` (model and
optimizer state), ``safetensors.torch.load_file(FILE)`` for ``.safetensors`` (model weights).

Only a checkpoint whose manifest the ledger recorded is read (its DCP metadata is a pickle): ``--ledger`` names
the ledger of the run that saved it. An unrecorded, damaged or altered folder is refused with exit 2."""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.dist import convert
from ..checkpoint.io import CheckpointError
from ..checkpoint.trust import LoadPolicy
from .common import UsageError, add_ledger_arg, command_parser, existing_ledger, out_console

HELP = """examples:
  pilotrun convert runs/RUN/checkpoints/step-000008 --out step8.pt
  pilotrun convert runs/RUN/checkpoints/step-000008 --out step8-weights.safetensors --ledger runs/ledger.sqlite"""


def add_parser(sub) -> None:
    p = command_parser(sub, "convert", __doc__, HELP)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--out", type=Path, required=True, help="FILE.pt or FILE.safetensors")
    add_ledger_arg(p, "the checkpoint's manifest must be recorded there")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.out.suffix not in (".pt", ".safetensors"):
        raise UsageError(f"--out must end in .pt or .safetensors, got {args.out.name}")
    if not args.checkpoint.is_dir():
        raise UsageError(f"no checkpoint folder at {args.checkpoint}")
    from ..ledger.store import Ledger

    with Ledger(existing_ledger(args)) as led:
        policy = LoadPolicy.from_ledger(led)
    try:
        info = convert(args.checkpoint, args.out, policy)
    except CheckpointError as exc:  # damaged, unrecorded, or torch could not read it: named, exit 2
        raise UsageError(f"{exc}\nnothing was written to {args.out}") from None
    out_console().print(f"wrote {info['path']} ({', '.join(f'{k} {v}' for k, v in info.items() if k != 'path')})",
                        markup=False)
    return 0
