"""``pilotrun archive RUN_OR_CAMPAIGN``: the model, config, lock, raw metrics and a README on reloading it,
in one .tar.gz."""
from __future__ import annotations

import json
from pathlib import Path

from ..config.ids import id_problem
from ..humanize import human_bytes
from ..ledger.store import Ledger, LedgerError
from ..report.archive import ArchiveError, archive_run
from .common import UsageError, add_ledger_arg, command_parser, existing_ledger, out_console

HELP = """examples:
  pilotrun archive lr-sweep-2026-r01                      # writes lr-sweep-2026-r01.tar.gz here
  pilotrun archive lr-sweep-2026                          # the campaign: every run, conclusion, report.html
  pilotrun archive tiny-sft-2026 --out /mnt/keep/pilot.tar.gz
  tar xzf lr-sweep-2026-r01.tar.gz && python lr-sweep-2026-r01/rerun_control.py   # exit 0: outputs match

A run without a model (diverged, failed) is archived too; its README says why there is no model."""


def add_parser(sub) -> None:
    p = command_parser(sub, "archive", __doc__, HELP)
    p.add_argument("run", help="a run or campaign id (a unique prefix is enough)")
    p.add_argument("--out", type=Path, help="the archive (default: RUN_ID.tar.gz in the current folder)")
    add_ledger_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    path = existing_ledger(args)
    with Ledger(path) as led:
        try:
            found = led.run(args.run) if args.out is None else None
            if found is not None and (why := id_problem(found["run_id"])) is not None:
                # A ledger written before ids were checked (`--run-id ../../x`): its id would name a file elsewhere.
                raise UsageError(f"the run id {found['run_id']!r} cannot name the archive ({why}); pass --out FILE")
            out, summary = archive_run(led, args.run, args.out)
        except (ArchiveError, LedgerError) as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"archive": str(out), **summary}, indent=1))
        return 0
    if summary["kind"] == "campaign":
        what = f"{summary['runs']} runs, {summary['models']} with a model"
        if summary["runs_without_folder"]:
            what += f"; folders gone (rows kept in the CSVs): {', '.join(summary['runs_without_folder'])}"
    else:
        what = "with its model" if summary["model"] else f"without a model ({summary['why_no_model']})"
    out_console().print(f"wrote {out} ({human_bytes(summary['bytes'])}, {summary['files']} files) {what}",
                        highlight=False, markup=False)
    if summary.get("left_out"):
        out_console().print(f"not packed (not in the model's manifest): {', '.join(summary['left_out'])}",
                            highlight=False, markup=False)
    others = [t for t in summary.get("not_packed") or [] if "not in the model's manifest" not in t]
    if others:  # a link, a file outside the run, a factory module that changed: named here and in the README
        out_console().print("not packed: " + "; ".join(others), highlight=False, markup=False)
    return 0
