"""``pilotrun select SPEC``: the selection sheet — per accelerator, what fits, how, and how long it takes."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..estimate.catalog import CatalogError, find, load_catalog
from ..estimate.experiments import OTHER_EXPERIMENT_NOTE, adapter_line, other_experiments
from ..estimate.runner import Traces
from ..estimate.select import path_cell, path_notes, sheet_row, with_inter_node
from ..estimate.stack import installed_extensions
from ..estimate.worker import TraceError
from ..humanize import human_bytes, human_seconds, money
from ..ui.tables import Column, Footnotes, fit_table, print_table
from .common import UsageError, add_ledger_arg, command_parser, err_console, ledger_if_present, out_console
from .estimate import add_trace_cache_arg, load_estimated, print_program_job, print_trace_notes, traces_for
from .skypilot_task import SKYPILOT_HELP, add_skypilot_args, check_args, write_task

HELP = """examples:
  pilotrun select examples/llama-7b-estimate/pilot.yaml
  pilotrun select pilot.yaml --markdown > selection.md
  pilotrun select pilot.yaml --json
  pilotrun select pilot.yaml --catalog examples/catalog/my-gpus.yaml   # prices: cost per update and in total
  pilotrun select pilot.yaml --accelerator H100-80GB --accelerator MI300X-192GB --headroom 0.1
  pilotrun select pilot.yaml --accelerator H100-80GB --skypilot task.yaml --bucket my-runs   # that row as a task
  pilotrun select examples/llama-70b-estimate/pilot.yaml --accelerator H100-80GB --inter-node-gb-s 50   # 2+ nodes

For each accelerator: the first configuration that fits with headroom, in the fix order (single device,
activation checkpointing, FSDP over 2/4/8, then over 2, 4, 8, 16 nodes of the catalog's gpus_per_node, a smaller
micro batch with more accumulation holding the examples per update), the largest micro batch and length that fit,
and the time for train.updates. Across nodes collectives run at --inter-node-gb-s (or the catalog's
inter_node_gb_s; without either the time is a lower bound, said so). With prices in a
catalog file (price_per_gpu_hour, see docs/catalog.md and examples/catalog/my-gpus.yaml) each time has its cost.

""" + SKYPILOT_HELP + """ From select the pipeline items take plan's default assumptions (`pilotrun plan
--skypilot` takes its flags)."""


def add_inter_node_arg(p) -> None:
    p.add_argument("--inter-node-gb-s", type=float, metavar="GB_S",
                   help="the rental's link between nodes, GB/s per GPU (e.g. 50 for 400 Gb/s InfiniBand per GPU): "
                        "collectives over several nodes run at it (default: the catalog's interconnect.inter_node_gb_s;"
                        " without either the intra-node link is used and the time is a lower bound)")


def add_parser(sub) -> None:
    p = command_parser(sub, "select", __doc__, HELP)
    p.add_argument("spec")
    p.add_argument("--accelerator", action="append", default=[])
    p.add_argument("--catalog", type=Path)
    add_ledger_arg(p)
    add_inter_node_arg(p)
    p.add_argument("--headroom", type=float,
                   help="share of device memory kept free, 0 to 0.5 (default from the catalog, 5%%)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--other-experiments", action="store_true",
                   help="for a full fine-tune, also list LoRA and QLoRA versions of the job, each labelled as a "
                        "different experiment (they train other parameters: never a memory fix)")
    add_trace_cache_arg(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true")
    add_skypilot_args(p)
    p.set_defaults(func=main)


def build_sheet(spec, args, headroom, quiet) -> tuple[list[dict], Traces]:
    """The sheet's rows for ``args.accelerator`` (``args.catalog``, ``args.ledger``, ``args.no_trace_cache``)."""
    if headroom is not None and not 0.0 <= headroom <= 0.5:
        raise UsageError(f"--headroom is a share of device memory kept free, from 0 to 0.5; got {headroom}")
    try:
        catalog = load_catalog(args.catalog)
        accs = [find(catalog, a) for a in args.accelerator] or list(catalog.values())
    except CatalogError as exc:
        raise UsageError(str(exc)) from None
    link = getattr(args, "inter_node_gb_s", None)
    if link is not None:
        if not link > 0:
            raise UsageError(f"--inter-node-gb-s is the link between nodes in GB/s per GPU, above 0 (e.g. 50); got "
                             f"{link}")
        accs = [with_inter_node(a, link, f"--inter-node-gb-s {link:g}") for a in accs]
    traces = traces_for(spec, args)
    ledger = ledger_if_present(args.ledger)
    ext = installed_extensions(spec.folder)
    console = out_console()
    try:
        with (console.status("tracing with fake tensors...") if not quiet else contextlib.nullcontext()):
            rows = [sheet_row(spec, traces, acc, ledger, ext, headroom) for acc in accs]
            for _label, other in (other_experiments(spec) if getattr(args, "other_experiments", False) else []):
                other_traces = traces_for(other, args)
                rows += [sheet_row(other, other_traces, acc, ledger, ext, headroom) | {"experiment": _label}
                         for acc in accs]
                traces.notes += other_traces.notes
    except TraceError as exc:
        raise UsageError(f"the trace failed: {exc}") from None
    return rows, traces


def price_notes(rows: list[dict]) -> list[str]:
    return [r["cost_note"] for r in rows if r.get("cost_note")]


def _length(spec, row: dict) -> str:
    """The largest sequence length that fits, at the micro batch it was computed for (the spec's, not the row's
    chosen one); "n/a" for data without one (images), not "0"."""
    if not spec.data.max_length:
        return "n/a"
    at = row.get("largest_length_at_micro_batch")
    return f"{row['largest_length']} at mb {at}" if at else str(row["largest_length"])


def time_notes(rows: list[dict]) -> list[str]:
    """Why each row that fits shows no time ("n/a"): its reason, once per accelerator; and a time that uses a
    recompute cost `pilotrun variants` measured there."""
    return list(dict.fromkeys([f"{r['accelerator']}: time n/a: {r['time_reason']}" for r in rows
                               if r.get("time_reason")]
                              + [f"{r['accelerator']}: {r['measured_recompute']}" for r in rows
                                 if r.get("measured_recompute")]))


def gpus_cell(row: dict) -> str:
    """The GPUs a row runs on: "8", or "16 = 2 x 8" over nodes (nodes x GPUs per node)."""
    nodes = row.get("nodes") or 1
    return str(row["gpus"]) + (f" = {nodes} x {row['gpus'] // nodes}" if nodes > 1 else "")


def inter_node_notes(rows: list[dict]) -> list[str]:
    """The link each row over several nodes is timed at, and where that figure came from."""
    return list(dict.fromkeys(
        f"{r['accelerator']}: {r['nodes']} nodes x {r['gpus'] // r['nodes']} GPUs; between nodes "
        + (f"{r['inter_node']['gb_s']:g} GB/s per GPU ({r['inter_node']['from']})" if r["inter_node"]["gb_s"]
           else r["inter_node"]["from"]) for r in rows if r.get("fits") and r.get("inter_node")))


def batch_notes(rows: list[dict]) -> list[str]:
    return [r["batch_note"] for r in rows if r.get("fits") and r.get("batch_note")]


def sheet_notes(rows: list[dict]) -> list[str]:
    """The lines under the sheet: prices, times, faster paths, links between nodes, batches that moved."""
    return price_notes(rows) + time_notes(rows) + path_notes(rows) + inter_node_notes(rows) + batch_notes(rows)


def _hours(hours: float | None) -> str:
    """The planned updates' duration in a unit that shows it ("40 s", not "0.0 h"); "—" when it does not fit."""
    return human_seconds(hours * 3600) if hours else "—"


def markdown(spec, rows: list[dict], job=None) -> str:
    cols = ["accelerator", "memory/device", "fits", "strategy", "GPUs", "precision", "micro batch x accum",
            "largest micro batch", "largest length", "device used", "time/update", "faster path", "cost/update",
            "time for updates", "cost for updates", "stack", "experiment"]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    lines = [f"# Selection sheet: {spec.name}", "", f"{spec.train.updates} updates, "
             f"{spec.train.micro_batch_size * spec.train.grad_accum_steps} examples per update, "
             + (f"length {spec.data.max_length}, " if spec.data.max_length else "")
             + f"{spec.train.precision}.", ""]
    if job is not None:
        lines += [f"The job as the program describes it ({job.facts.framework}; {job.described}):", ""]
        lines += [f"- {f.line()}" for f in job.provenance] + [""]
    lines.append(head)
    for r in rows:
        ok = r["fits"]
        lines.append(
            f"| {r['accelerator']} | {human_bytes(r['memory_per_device_bytes'])} | {'yes' if ok else 'no'} | "
            f"{r['strategy']}{' + AC' if r['activation_checkpointing'] else ''} | {gpus_cell(r)} | {r['precision']} | "
            f"{r['micro_batch_size']} x {r['grad_accum_steps']} | {r['largest_micro_batch']} | {_length(spec, r)} | "
            f"{human_bytes(r['device_used_bytes'])} | {human_seconds(r['seconds_per_update']) if ok else '—'} | "
            f"{path_cell(r)} | {money(r['cost_per_update'])} | "
            f"{_hours(r['hours_for_planned_updates'])} | "
            f"{money(r['cost_for_planned_updates'])} | {r['software_stack']['text']} | {r['experiment']} |")
    lines += ["", *dict.fromkeys(f"- {adapter_line(r['adapter'])}" for r in rows if r.get("adapter"))]
    if len({r["experiment"] for r in rows}) > 1:
        lines += ["", OTHER_EXPERIMENT_NOTE[0].upper() + OTHER_EXPERIMENT_NOTE[1:] + "."]
    lines += ["", "Largest sizes assume activations scale linearly with micro batch and length (flash attention). "
              "Times: each row's utilisation_source (the model, or the pilot that measured it). "
              "Costs are GPUs x hours x the catalog's price_per_gpu_hour."]
    lines += [f"- {n}" for n in sheet_notes(rows)]
    return "\n".join(lines) + "\n"


# Left out first when the console is too narrow: the costs (often "—" without prices), then sizes the rest
# of the row implies; the accelerator, whether it fits, how, and the time always stay.
_SHEET_COLUMNS = (Column("accelerator"), Column("memory", "right", 3), Column("fits"), Column("strategy"),
                  Column("GPUs", "right"), Column("mb x accum"), Column("max mb", "right", 4),
                  Column("max length", "left", 2), Column("used", "right", 5), Column("time/update", "right"),
                  Column("faster path", "left", 1), Column("cost/update", "right", 7))


def sheet_table(spec, rows: list[dict], width: int) -> tuple[Table, list[str], Footnotes]:
    """The selection sheet as one line per row within ``width``: each software stack (a sentence) is a numbered
    footnote; the headers left out to fit; the footnotes."""
    notes = Footnotes(limit=0)  # every stack is a sentence: a mark always, so the column stays narrow
    several = len({r["experiment"] for r in rows}) > 1
    columns = (((Column("experiment"),) if several else ()) + _SHEET_COLUMNS
               + (Column(f"{spec.train.updates} updates", "right"), Column("cost", "right", 6), Column("stack")))
    cells = []
    for r in rows:
        ok = r["fits"]
        cells.append([*((r["experiment"],) if several else ()), r["accelerator"],
                      human_bytes(r["memory_per_device_bytes"]),
                      Text("yes" if ok else "no", style="green" if ok else "red"),
                      (r["strategy"] + (" + AC" if r["activation_checkpointing"] else "")) if ok else "—",
                      gpus_cell(r) if ok else "—",
                      f"{r['micro_batch_size']} x {r['grad_accum_steps']}" if ok else "—",
                      str(r["largest_micro_batch"]) if ok else "—", _length(spec, r) if ok else "—",
                      human_bytes(r["device_used_bytes"]), human_seconds(r["seconds_per_update"]) if ok else "—",
                      path_cell(r), money(r["cost_per_update"]), _hours(r["hours_for_planned_updates"]),
                      money(r["cost_for_planned_updates"]), notes.cell(r["software_stack"]["text"])])
    table, dropped = fit_table(columns, cells, width, title=f"selection sheet · {spec.name}")
    return table, dropped, notes


def main(args) -> int:
    check_args(args)
    spec, job = load_estimated(args, quiet=args.json or args.markdown)
    rows, traces = build_sheet(spec, args, args.headroom, args.json or args.markdown)
    if args.skypilot is not None:  # one accelerator (check_args): its first row is the job as specified
        err_console().print(escape(write_task(spec, args, rows[0], traces)), highlight=False)
    if args.json:
        print(json.dumps({"spec": spec.source, "rows": rows, "trace_cache": traces.notes,
                          "program": job.to_dict() if job is not None else None}, indent=1, default=str))
        return 0
    print_trace_notes(traces)
    if args.markdown:
        print(markdown(spec, rows, job), end="")
        return 0
    console = out_console()
    if job is not None:
        print_program_job(console, job)
    table, dropped, notes = sheet_table(spec, rows, console.width)
    print_table(console, table, dropped, notes, more="--markdown or --json")
    console.print(Text(f"{spec.train.precision}; examples per update held at "
                       f"{spec.train.micro_batch_size * spec.train.grad_accum_steps}; largest sizes assume activations "
                       "scale linearly (flash attention); time: " + rows[0]["utilisation_source"], style="dim"))
    for line in dict.fromkeys(adapter_line(r["adapter"]) for r in rows if r.get("adapter")):
        console.print(Text(line, style="dim"))
    if len({r["experiment"] for r in rows}) > 1:
        console.print(Text(OTHER_EXPERIMENT_NOTE, style="dim"))
    for note in sheet_notes(rows):
        console.print(Text(note, style="dim"))
    return 0
