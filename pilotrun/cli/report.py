"""``pilotrun report RUN_OR_CAMPAIGN``: one self-contained HTML file people would rather look at than read."""
from __future__ import annotations

from pathlib import Path

from ..ledger.store import Ledger, LedgerError
from ..report.html import render
from .common import UsageError, add_ledger_arg, command_parser, existing_ledger, out_console

HELP = """examples:
  pilotrun report tiny-sft-2026                    # a pilot: gates, memory per stage vs capacity, curves, lock
  pilotrun report lr-sweep-2026 --out sweep.html   # a campaign: every run, curves per variant and seed, conclusion

Put `pilotrun select ... --json` / `pilotrun plan ... --json` output as selection.json / plan.json in the run's
folder to have them in the report too."""


def add_parser(sub) -> None:
    p = command_parser(sub, "report", __doc__, HELP)
    p.add_argument("run", help="a run or campaign id (a unique prefix is enough)")
    p.add_argument("--out", type=Path, help="the HTML file (default: report.html in the run's folder)")
    add_ledger_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    path = existing_ledger(args)
    with Ledger(path) as led:
        try:
            page, run = render(led, args.run)
        except KeyError:
            raise UsageError(f"no run or campaign {args.run!r} in {path}; see `pilotrun ledger`") from None
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
    out = args.out or Path(run["out_dir"] or ".") / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    out_console().print(f"wrote {out} ({len(page) / 1024:.0f} KiB, self-contained)", markup=False)
    return 0
