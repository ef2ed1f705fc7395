"""``pilotrun note "text"``: a timestamped decision or observation on a run or campaign, in the ledger."""
from __future__ import annotations

from ..ledger.store import Ledger, LedgerError
from .common import UsageError, add_ledger_arg, command_parser, existing_ledger, out_console

HELP = """examples:
  pilotrun note "chose bf16: fp16 overflowed in steady_step"          # on the latest run or campaign
  pilotrun note --run lr-sweep-2026 "control kept: 1e-3 was within seed spread\""""


def add_parser(sub) -> None:
    p = command_parser(sub, "note", __doc__, HELP)
    p.add_argument("text")
    p.add_argument("--run", help="run or campaign id (default: the latest)")
    add_ledger_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    path = existing_ledger(args)
    if not args.text.strip():
        raise UsageError("the note is empty")
    with Ledger(path) as led:
        try:
            run = led.run(args.run) if args.run else next(
                (r for r in led.runs(limit=50) if r["kind"] in ("pilot", "campaign")), None)
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
        if run is None:
            raise UsageError(f"no run {args.run!r}" if args.run else "no run or campaign in the ledger yet")
        led.add_note(run["run_id"], args.text.strip())
    out_console().print(f"noted on {run['run_id']}", markup=False)
    return 0
