"""``pilotrun estimate SPEC``: per-stage peaks traced with fake tensors, and the fit on each accelerator."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from .. import strategies
from ..config.load import load_spec
from ..config.sections import ac_policy
from ..config.spec import Spec
from ..estimate.advise import advise
from ..estimate.cache import CACHE_ENV, TraceCache
from ..estimate.catalog import CatalogError, find, load_catalog
from ..estimate.experiments import adapter_line, adapter_view
from ..estimate.measured import measured_fixes
from ..estimate.model import estimate_fit, time_source
from ..estimate.moe import row as moe_row
from ..estimate.program_job import ProgramJob, Source, is_program_spec, load_job
from ..estimate.runner import Traces, calibrated_utilisation, stage_summary
from ..estimate.worker import TraceError
from ..humanize import at_length, human_bytes, human_count, human_seconds, money
from ..ledger.records import GateName
from ..ui.tables import Column, fit_table, print_table
from .common import UsageError, add_ledger_arg, command_parser, err_console, ledger_if_present, out_console

HELP = """examples:
  pilotrun estimate examples/llama-7b-estimate/pilot.yaml
  pilotrun estimate examples/hf-trainer/pilot.yaml --set model.config.n_layer=24 --set data.max_length=2048
  pilotrun estimate pilot.yaml --accelerator H100-80GB --gpus 4 --strategy fsdp
  pilotrun estimate pilot.yaml --gpus 8 --strategy fsdp --activation-checkpointing selective-2
  pilotrun estimate pilot.yaml --set model.attn_implementation=flash_attention_2
  pilotrun estimate pilot.yaml --accelerator a100 --json
  pilotrun estimate pilot.yaml --catalog my-gpus.yaml      # add or override accelerators (prices too)

Nothing is allocated and no weights are read: the model is built on the meta device and traced with
fake tensors in a separate process. Memory is at the longest batch; time is at the lengths the data gives
the micro batches (a built-in task's data.path, a sample of 2000 examples tokenized, each micro batch padded
to its longest) where they are known, else at the longest, and each row says which (time_lengths).
A program spec (program: without all of model, data and train) is described by its program: run once
(so it builds its model and reads its data as it always does) until it describes its job (the
transformers/Lightning callback at train begin, or job.describe), before its first update; the spec's
model/data/train and --set override what it said. Attention is traced as the accelerator runs it
(model.attn_implementation, else the model's own: sdpa keeps output + logsumexp, not L x L), and FSDP2's
communication overlaps its compute as it prefetches. Without --gpus, DDP and FSDP are shown over 2, 4 and
8 GPUs. Traces (and a program's description) are cached as JSON under $PILOTRUN_CACHE (default
~/.cache/pilotrun), shared with select and plan; --no-trace-cache traces (and describes) again and
replaces the cached entry."""


def add_parser(sub) -> None:
    p = command_parser(sub, "estimate", __doc__, HELP)
    p.add_argument("spec")
    p.add_argument("--accelerator", action="append", default=[], help="catalog name or alias (repeatable; default all)")
    p.add_argument("--gpus", type=int, help="GPUs for ddp/fsdp (default 2, 4 and 8)")
    p.add_argument("--strategy", choices=strategies.names(), action="append", default=[],
                   help=f"repeatable; default all: {', '.join(strategies.names())}")
    p.add_argument("--catalog", type=Path, help="a YAML catalog that extends or overrides the built-in one")
    add_ledger_arg(p, "for utilisation measured by earlier pilots")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--activation-checkpointing", metavar="on|off|POLICY",
                   help="trace with activation checkpointing on (full) or off, or a policy: full, selective, "
                        "selective-N (one matmul in N kept; selective-2 is torchtitan's op policy), every-N "
                        "(default: the spec's)")
    p.add_argument("--no-advice", action="store_true", help="skip the variants for rows that do not fit")
    add_trace_cache_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    spec, job = load_estimated(args, quiet=args.json)
    try:
        catalog = load_catalog(args.catalog)
        accs = [find(catalog, a) for a in args.accelerator] or list(catalog.values())
    except CatalogError as exc:
        raise UsageError(str(exc)) from None
    if args.gpus is not None and args.gpus < 1:
        raise UsageError("--gpus must be at least 1")
    chosen = [strategies.get(s) for s in (args.strategy or strategies.names())]
    multi = [s.name for s in chosen if s.multi_process]
    if args.gpus == 1 and multi and args.strategy:
        raise UsageError(f"{' and '.join(multi)} need --gpus 2 or more (one GPU is --strategy single)")
    gpu_counts = [args.gpus] if args.gpus else [2, 4, 8]
    console = out_console()
    traces = traces_for(spec, args)
    ac = _ac_flag(args.activation_checkpointing)
    try:
        with (console.status("tracing the update with fake tensors (no memory, no GPU)...") if not args.json
              else contextlib.nullcontext()):
            trace = traces.get(ac=ac)
    except TraceError as exc:
        raise UsageError(f"the trace failed: {exc}") from None
    ledger = ledger_if_present(args.ledger)
    fits = []
    for acc in accs:
        util, source = calibrated_utilisation(ledger, spec.pilot_hash(), acc,
                                              trace["stages"][GateName.STEADY_STEP]["flops"], spec.train.precision)
        for strategy in chosen:
            for n in (gpu_counts if strategy.multi_process else [1]):
                if strategy.multi_process and n == 1:
                    continue
                fit = estimate_fit(trace, acc, strategy.name, n, utilisation=util, lengths=traces.lengths())
                fit["utilisation_source"] = time_source(fit["time"], source if util else None)
                s = fit["seconds_per_update"]
                fit["cost_per_update"] = acc.cost(s / 3600 if s else None, n)
                fit["cost_note"] = acc.price_note()
                fits.append(fit)
    advice = {}
    if not args.no_advice and len(accs) == 1 and not any(f["fits"] for f in fits):
        first = fits[0]
        with console.status("working out variants...") if not args.json else contextlib.nullcontext():
            try:
                offered = advise(spec, traces, accs[0], first["strategy"], first["gpus"], catalog,
                                 measured=measured_fixes(ledger, spec.pilot_hash()))
                advice[accs[0].name] = [a.to_json() for a in offered]
            except TraceError as exc:  # a fix's trace failed: the fits above still answer
                err_console().print(Text(f"no advice: tracing a fix failed: {exc}", style="yellow"))
    report = {"spec": spec.source, "config_hash": spec.config_hash(), "stages": stage_summary(trace),
              "model": {k: trace[k] for k in ("parameters", "trainable_parameters", "parameter_bytes",
                                               "gradient_bytes", "optimizer_state_bytes", "largest_layer",
                                               "largest_layer_bytes", "layers", "precision",
                                               "activation_checkpointing")},
              "adapter": adapter_view(trace, spec), "optimizer": trace.get("optimizer"),
              "trace_seconds": trace["seconds"], "trace_cache": traces.notes,
              "fits": [{k: f[k] for k in ("accelerator", "strategy", "gpus", "precision", "peak_allocated_bytes",
                                          "peak_reserved_bytes", "device_used_bytes", "capacity_bytes", "fits",
                                          "limiting_stage", "seconds_per_update", "cost_per_update", "cost_note",
                                          "utilisation_source", "unknown_for_stack", "time_lengths", "offload",
                                          "host_bytes_per_node")}
                       | {"corrections": f["stages"][f["limiting_stage"]]["corrections"] + f["notes"],
                          "time": f["time"]} for f in fits],
              "attention": trace.get("attention") or {},
              "moe": moe_row(trace.get("moe") or {}),
              "advice": advice, "program": job.to_dict() if job is not None else None}
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    if job is not None:
        print_program_job(console, job)
    _print(console, spec, trace, report)
    print_trace_notes(traces)
    return 0


def load_estimated(args, quiet: bool) -> tuple[Spec, ProgramJob | None]:
    """The spec to trace: as written, or for a program spec the job the program describes (run once, cached) under
    what the spec and ``--set`` write."""
    if not is_program_spec(args.spec):
        return load_spec(args.spec, args.overrides, check_files=False), None
    with (err_console().status("describing the program's job (running it until it describes its model, before its "
                               "first update)...") if not quiet else contextlib.nullcontext()):
        job = load_job(args.spec, args.overrides, refresh=getattr(args, "no_trace_cache", False))
    return job.spec, job


def print_program_job(console, job: ProgramJob) -> None:
    """Where each value of a program's estimated job came from, grouped: the program, the spec, --set, assumed."""
    f = job.facts
    console.print(Text.assemble(("the program's job ", "bold"), f"({f.framework}: {f.model_class.rsplit('.', 1)[-1]}, "
                                f"{f.parameters:,} parameters, {f.trainable_parameters:,} trainable, "
                                f"{f.world_size} process(es)); {job.described}"))
    for source in Source:
        facts = [x for x in job.provenance if x.source is source]
        if not facts:
            continue
        console.print(Text(f"  from {source}:" if source is not Source.ASSUMED else "  assumed:",
                           style="yellow" if source is Source.ASSUMED else "bold"))
        for x in facts:
            console.print(Text(f"    {x.line(source=False)}", style="yellow" if source is Source.ASSUMED else ""),
                          highlight=False)
    for note in f.notes:
        console.print(Text(f"  {note}", style="dim"))


def _ac_flag(value: str | None) -> bool | str | None:
    """--activation-checkpointing as train.activation_checkpointing takes it; exit 2 naming the values."""
    if value is None:
        return None
    ac: bool | str = {"on": True, "off": False}.get(value, value)
    try:
        ac_policy(ac)
    except ValueError as exc:
        raise UsageError(f"--activation-checkpointing: {exc}") from None
    return ac


def add_trace_cache_arg(p) -> None:
    p.add_argument("--no-trace-cache", action="store_true",
                   help=f"trace again instead of reading the cached trace (${CACHE_ENV}/traces, default "
                        "~/.cache/pilotrun/traces); the new trace replaces it")


def traces_for(spec, args) -> Traces:
    return Traces(spec, cache=TraceCache.default(), refresh=args.no_trace_cache)


def print_trace_notes(traces: Traces) -> None:
    """Whether each trace was cached or new, on stderr: the tables on stdout stay the answer."""
    for note in traces.notes:
        err_console().print(Text(note, style="dim"))


_STAGE_COLUMNS = (Column("stage"), Column("peak", "right"), Column("parameters", "right"),
                  Column("gradients", "right"), Column("optimizer", "right"), Column("activations", "right"),
                  Column("weight casts", "right", 1))
# Left out first on a narrow console: the cost (often "—" without prices), the capacity (in the catalog), the
# allocated share of what is used, the stage that limits it.
_FIT_COLUMNS = (Column("accelerator"), Column("strategy"), Column("GPUs", "right"), Column("allocated", "right", 2),
                Column("device used", "right"), Column("capacity", "right", 3), Column("fits"),
                Column("worst stage", "left", 1), Column("time/update", "right"), Column("cost/update", "right", 4))


def stage_table(st: dict, width: int) -> tuple[Table, list[str]]:
    """The traced per-stage peaks on one device, one line per stage within ``width``."""
    rows: list[list] = []
    for name in (GateName.FIRST_STEP, GateName.STEADY_STEP, GateName.EVAL):
        b = st[name]["breakdown"]
        rows.append([name, human_bytes(st[name]["peak_bytes"]), human_bytes(b.get("parameters")),
                     human_bytes(b.get("gradients")), human_bytes(b.get("optimizer")),
                     human_bytes(b.get("activations")), human_bytes(b.get("weight_casts"))])
    rows.append(["save", human_bytes(st[GateName.SAVE]["peak_bytes"]), "", "", "", "", ""])
    return fit_table(_STAGE_COLUMNS, rows, width,
                     title="per-stage peaks on one device (traced, before target corrections)")


def fit_table_of(fits: list[dict], width: int) -> tuple[Table, list[str]]:
    """The fit per accelerator, one line per accelerator within ``width``."""
    rows = [[r["accelerator"], r["strategy"], str(r["gpus"]), human_bytes(r["peak_allocated_bytes"]),
             human_bytes(r["device_used_bytes"]), human_bytes(r["capacity_bytes"]),
             Text("yes" if r["fits"] else "no", style="green" if r["fits"] else "red"), r["limiting_stage"],
             human_seconds(r["seconds_per_update"]), money(r["cost_per_update"])] for r in fits]
    return fit_table(_FIT_COLUMNS, rows, width, title="fit per accelerator")


def _print(console, spec, trace, report) -> None:
    st = report["stages"]
    console.print(Text.assemble(("estimate ", "bold"), (spec.name, "bold cyan"),
                                f" · {human_count(trace['parameters'])} parameters · {spec.train.precision} · "
                                f"micro batch {spec.train.micro_batch_size} x {spec.train.grad_accum_steps}"
                                f"{at_length(spec.data.max_length)} · traced in {trace['seconds']:.1f} s"))
    if report.get("adapter"):
        console.print(Text(adapter_line(report["adapter"]), style="cyan"))
    if report.get("moe"):
        m = report["moe"]
        console.print(Text(f"mixture of experts: {m['experts']} experts x {m['moe_layers']} layers, "
                           f"{m['active_experts_per_token']} active per token; routing {m['routing']['assumption']}; "
                           "expert parallelism not modelled (the 'mixture of experts' correction says what was "
                           "counted)", style="cyan"))
    limit = trace.get("max_positions")
    if limit and spec.data.max_length and spec.data.max_length > limit:
        console.print(Text(f"length {spec.data.max_length} is beyond the model's {limit} positions "
                           "(max_position_embeddings): the long run cannot train at it; the trace ran it anyway",
                           style="bold yellow"))
    if trace.get("optimizer"):
        console.print(Text(f"optimizer: {trace['optimizer']}; state {human_bytes(trace['optimizer_state_bytes'])}",
                           style="dim"))
    for table, dropped in (stage_table(st, console.width), fit_table_of(report["fits"], console.width)):
        print_table(console, table, dropped)
    console.print(Text("fit: per-rank device memory incl. context, workspaces, collective buffers, allocator margin",
                       style="dim"))
    for note in dict.fromkeys(r["cost_note"] for r in report["fits"] if r["cost_note"]):
        console.print(Text(note, style="dim"))
    if report["fits"]:
        first = report["fits"][0]
        console.print(Text(f"corrections for {first['accelerator']} ({first['strategy']}, {first['limiting_stage']}):",
                           style="bold"))
        for c in first["corrections"]:
            console.print(f"  {c['name']:<44} {human_bytes(c['bytes']):>10}  {c['reason']}", highlight=False)
        comm = first["time"].get("communication_model")
        console.print(Text(f"time: {first['utilisation_source']}" + (f"; communication {comm}" if comm and first[
            "time"].get("communication_seconds") else ""), style="dim"))
    unaligned = next((r["time"]["unaligned_matmuls"] for r in report["fits"] if r["time"].get("unaligned_matmuls")),
                     None)
    if unaligned:   # the same matmuls on every accelerator: said once
        console.print(Text(f"time is {unaligned['note']}", style="yellow"))
    for acc in dict.fromkeys(r["accelerator"] for r in report["fits"] if r.get("unknown_for_stack")):
        row = next(r for r in report["fits"] if r["accelerator"] == acc)
        console.print(Text(f"{acc}: {', '.join(row['unknown_for_stack'])} unknown for its stack (no measurement "
                           "known): CUDA's figures used", style="yellow"))
    for acc, variants in report["advice"].items():
        console.print(Text(f"\ndoes not fit on {acc}: combinations of fixes in order of cost, up to the cheapest "
                           "that fits (the maximum length is never cut)", style="bold yellow"))
        for v in variants:
            mark = Text("fits", style="green") if v["fits"] else Text("no", style="red")
            tf = f"{v['time_factor']:.2f}x time" if v["time_factor"] else "time n/a"
            cheapest = Text(" <- the cheapest that fits", style="bold green") if v["cheapest_that_fits"] else ""
            console.print(Text.assemble("  ", mark, f"  {v['variant']}: {human_bytes(v['device_used_bytes'])} per GPU, "
                                                    f"{tf}; {v['experiment']}; {v['reason']}", cheapest))
