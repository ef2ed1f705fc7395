"""``pilotrun variants SPEC``: the memory fixes run beside the control, measured, and checked for quality."""
from __future__ import annotations

import contextlib
import json

from rich.table import Table
from rich.text import Text

from ..humanize import human_bytes
from ..ledger.details import VariantDetails
from ..ledger.records import Verdict
from ..ledger.store import default_ledger_path
from ..variants.judge import share
from ..variants.run import run_variants
from .common import EXIT_GATE_FAILED, EXIT_OK, add_ledger_arg, command_parser, out_console

HELP = """examples:
  pilotrun variants examples/tiny-sft/pilot.yaml
  pilotrun variants pilot.yaml --set pilot.variants.run='[checkpointing, bf16]' --set pilot.variants.updates=20
  pilotrun variants pilot.yaml --set 'pilot.variants.custom={lr-half: {train.optimizer.lr: 1.5e-3}}' --json

The control (the spec as written) and each variant train the same updates from the same initial weights on the
same examples in one process: micro batch /2 with accumulation x2, activation checkpointing, bf16, fp16 with a
grad scaler, bf16-true (each one that differs from the control), and any under pilot.variants.custom. The first
2 updates of each are measured for memory, the rest timed in interleaved rounds; then each is validated. A row per
configuration goes to the ledger, each variant's linked to the control's; estimate's advisor, select and plan
then use a checkpointing policy's measured recompute cost where it ran on the target accelerator.
A variant fails when its loss or gradients go non-finite, its fp16 scaler steps off the update boundary, or its
validation loss is beyond pilot.variants.val_loss_rtol of the control's; it warns when it saves no memory, its
scaler skipped updates, or it changes the question (examples per update, max length, data, an adapter): a
different experiment, never a memory fix.
exit codes: 0 no variant failed, 1 one failed (or the control did), 2 bad spec or flag, 3 internal error"""


def add_parser(sub) -> None:
    p = command_parser(sub, "variants", __doc__, HELP)
    p.add_argument("spec")
    add_ledger_arg(p)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    console = out_console()
    ledger = args.ledger or default_ledger_path()
    status = (console.status("building the control and its variants...") if not args.json
              else contextlib.nullcontext())
    with status as live:
        def progress(what: str) -> None:
            if live is not None:
                live.update(f"variants: {what}")

        result = run_variants(args.spec, args.overrides, ledger, on_progress=progress)
    failed = any(a.row is not None and a.row.verdict == Verdict.FAIL for a in result.arms)
    if args.json:
        print(json.dumps({"run_id": result.run_id, "device": result.device, "updates": result.updates,
                          "val_loss_rtol": result.rtol, "rows": [a.row.to_dict() if a.row else {} for a in result.arms],
                          "not_run": {s.name: s.why for s in result.skipped}}, indent=1, default=str))
        return EXIT_GATE_FAILED if failed else EXIT_OK
    _print(console, result)
    return EXIT_GATE_FAILED if failed else EXIT_OK


def _pct(x: float | None) -> str:
    return "n/a" if x is None else share(x)


def _print(console, result) -> None:
    console.print(Text.assemble(("variants ", "bold"), (result.run_id, "bold cyan"),
                                f" · {result.updates} updates each on {result.device} · quality: val loss within "
                                f"{result.rtol:.0%} of the control's"))
    t = Table(box=None, header_style="bold")
    for col in ("variant", "verdict", "peak (live)", "vs control", "time", "loss diff max", "at last",
                "grad norm ratio", "val loss", "experiment"):
        t.add_column(col, justify="left" if col in ("variant", "verdict", "experiment") else "right")
    style = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    for arm in result.arms:
        d = VariantDetails.of(arm.row.details if arm.row else None)
        n = d.numerics or {}
        gn = n.get("grad_norm_ratio_last")
        verdict = str(arm.row.verdict) if arm.row else "?"
        t.add_row(arm.name, Text(verdict, style=style.get(verdict, "")),
                  human_bytes(d.peak_live_bytes), "" if d.peak_ratio is None else f"{d.peak_ratio:.2f}x",
                  "" if d.time_ratio is None else f"{d.time_ratio:.2f}x", _pct(n.get("loss_rel_diff_max")),
                  _pct(n.get("loss_rel_diff_last")), "" if gn is None else f"{gn:.3f}",
                  "n/a" if d.val_loss is None else f"{d.val_loss:.4g}", d.experiment or "")
    console.print(t)
    for arm in result.arms:
        console.print(f"  {arm.row.reason if arm.row else ''}", highlight=False)
    for s in result.skipped:
        console.print(Text(f"  not run: {s.name}: {s.why}", style="dim"))
    console.print(Text(f"peak: live tensor bytes of each configuration's model, optimizer and update over its first "
                       f"2 updates; time: median over interleaved rounds of its seconds per update / the control's. "
                       f"`pilotrun ledger --run {result.run_id}` shows the rows.", style="dim"))
