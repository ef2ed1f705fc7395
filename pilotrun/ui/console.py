"""The terminal: a live table of gates with a progress bar, and a summary readable in five seconds."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..humanize import human_bytes, human_seconds
from ..ledger.details import SteadyStepDetails
from ..ledger.records import GateName, GateRow, Verdict
from .tables import Column, Footnotes, fit_noted, print_table

if TYPE_CHECKING:
    from ..pilot.report import RankSummary

STYLE = {"pass": "bold green", "warn": "bold yellow", "fail": "bold red", "skip": "dim", "running": "cyan",
         "pending": "dim"}
MARK = {"pass": "✓", "warn": "!", "fail": "✗", "skip": "–", "running": "…", "pending": "·"}


def peak_of(row: GateRow) -> int:
    """A row's peak allocated bytes (0 when not measured)."""
    return row.memory.get("peak_allocated_bytes") or 0


# The narrowest reason worth a column: "out of memo…".
MIN_REASON = 12


def _clip(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: max(1, width - 1)] + "…"


def said(row: GateRow) -> str:
    """A row's reason as the report and the ledger keep it (its verdict where it gave none)."""
    return row.reason or str(row.verdict)


def gate_label(row: GateRow, rows: Sequence[GateRow] = ()) -> str:
    """The gate's name, with its rank where ``rows`` hold that gate for several ranks, or the row is not rank 0's (a
    program under torchrun writes one row per gate and rank: two identical "resume pass" lines said neither rank)."""
    if row.rank > 0 or len({r.rank for r in rows if r.gate == row.gate}) > 1:
        return f"{row.gate} [rank {row.rank}]"
    return row.gate


def gate_table(rows: Sequence[GateRow], pending: Sequence[str] = (), running: str | None = None,
               width: int | None = None, full: bool = False) -> Table:
    """Gates as rows; counters never measured on this device (reserved on CPU) get no column.

    Each reason is cut to one line of the width left by the other columns, unless ``full``: then it is
    whole, wrapped within that width (``pilotrun ledger --run ID --full``)."""
    counters = [("peak alloc", "peak_allocated_bytes"), ("peak resv", "peak_reserved_bytes"),
                ("host RSS", "host_rss_peak_bytes")]
    if not any(r.memory.get("peak_reserved_bytes") is not None for r in rows):
        del counters[1]
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", expand=False)
    # Fixed columns keep their width; only the reason gives way on a narrow terminal.
    gate_w = max([len(gate_label(r, rows)) for r in rows] + [len(p) for p in pending] + [4])

    def fixed() -> int:  # the mark, gate, verdict, time, the counters, and two spaces between columns
        return 1 + gate_w + 7 + 7 + 10 * len(counters) + 2 * (4 + len(counters))

    # Too narrow for a useful reason (80 columns, ranks in the labels): host RSS, then reserved, are left out
    # rather than every row cut by rich.
    while width and width - fixed() < MIN_REASON and len(counters) > 1:
        counters.pop()
    table.add_column("", width=1, no_wrap=True)
    table.add_column("gate", no_wrap=True, min_width=gate_w)
    table.add_column("verdict", no_wrap=True, min_width=7)
    table.add_column("time", justify="right", no_wrap=True, min_width=7)
    for header, _key in counters:
        table.add_column(header, justify="right", no_wrap=True, min_width=10)
    table.add_column("reason", no_wrap=not full, overflow="fold")
    # Rich collapses fixed columns when one cell is too wide; clip the reason ourselves instead.
    reason_w = max(MIN_REASON, width - fixed()) if width else None
    for r in rows:
        v, mem = r.verdict, r.memory
        cells: list[Text | str] = [Text(MARK[v], style=STYLE[v]), Text(gate_label(r, rows)),
                                   Text(str(v), style=STYLE[v]),
                                   human_seconds(r.seconds) if r.seconds is not None else ""]
        cells += [human_bytes(mem.get(key)) if mem.get(key) is not None else "" for _header, key in counters]
        # Text, not markup: a reason may quote "[...]" from an error.
        reason = said(r)
        cells.append(Text(reason if full else _clip(reason, reason_w)))
        table.add_row(*cells)
    for name in pending:
        state = "running" if name == running else "pending"
        table.add_row(Text(MARK[state], style=STYLE[state]), name, Text(state, style=STYLE[state]),
                      *([""] * (len(counters) + 2)))
    return table


def headline(rows: Sequence[GateRow], status: str) -> Text:
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in ("pass", "warn", "fail", "skip")}
    label = {"pass": "PASS", "warn": "PASS with warnings", "fail": "FAIL", "interrupted": "INTERRUPTED",
             "error": "ERROR"}.get(status, status.upper())
    text = Text(label, style=STYLE.get(status, "bold"))
    parts = [f"{counts['pass']} passed"]
    for v in ("warn", "fail", "skip"):
        if counts[v]:
            parts.append(f"{counts[v]} {'warned' if v == 'warn' else v + ('ed' if v == 'fail' else 'ped')}")
    text.append("  " + ", ".join(parts))
    # Gates whose memory is the job's own (declared by each gate; accum_equivalence and overfit measure private
    # copies). Imported here: the gates import torch, which `pilotrun ledger` does without.
    from ..gates.registry import job_memory_gates

    job_gates = job_memory_gates()
    measured = [r for r in rows if peak_of(r) and r.gate in job_gates]
    if measured:
        top = max(measured, key=peak_of)
        inp = top.inputs
        shape = ", ".join(x for x in (f"length {inp['seq_len']}" if inp.get("seq_len") else "",
                                       f"batch {inp.get('batch_size') or inp.get('micro_batch_size')}"
                                       if inp.get("batch_size") or inp.get("micro_batch_size") else "") if x)
        text.append(f" · largest tensor peak {human_bytes(peak_of(top))} in {top.gate}"
                    + (f" ({shape})" if shape else ""))
    steady = next((r for r in rows if r.gate == GateName.STEADY_STEP and r.verdict in (Verdict.PASS, Verdict.WARN)),
                  None)
    # A program's steady_step row times the stages the program wrapped, not an update: it has no per-update time,
    # and the headline said "n/a/update" (found piloting a plain loop).
    per_update = SteadyStepDetails.of(steady.details).seconds_per_update if steady else None
    if per_update is not None:
        text.append(f" · {human_seconds(per_update)}/update")
    return text


_RANK_COLUMNS = (Column("gate", whole=True), Column("worst"), Column("max peak alloc", "right"),
                 Column("max time", "right"), Column("imbalance"))


def rank_table(ranks: Sequence[RankSummary], width: int) -> tuple[Table, list[str], Footnotes]:
    """The gates over several ranks, one line each within ``width``; a long imbalance is a numbered footnote."""
    def rows(notes: Footnotes) -> list[list]:
        return [[r.gate, Text(str(r.verdict), style=STYLE[r.verdict]),
                 human_bytes(r.max_peak_allocated_bytes) if r.max_peak_allocated_bytes else "",
                 human_seconds(r.max_seconds) if r.max_seconds else "",
                 Text(notes.cell("; ".join(r.imbalance)), style="yellow") if r.imbalance else ""] for r in ranks]

    return fit_noted(_RANK_COLUMNS, rows, width, title=f"over {ranks[0].ranks} ranks")


class ConsoleObserver:
    """Live table on a terminal; one line per finished gate otherwise (CI logs, pipes)."""

    def __init__(self, console: Console | None = None, title: str = "") -> None:
        self.console = console or Console(stderr=False)
        self.title = title
        self.rows: list[GateRow] = []
        self.pending: list[str] = []
        self.running: str | None = None
        self.live: Live | None = None
        self.progress = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True)
        self.task: TaskID | None = None
        self._last_plain = 0.0

    # -- observer protocol ------------------------------------------------------
    def on_start(self, run_id: str, out_dir: Path, gates: list[str], notes: list[str]) -> None:
        self.pending = list(gates)
        self.console.print(Text.assemble(("pilotrun ", "bold"), (self.title, "bold cyan"), f" · run {run_id}"))
        for n in notes:
            self.console.print(Text(f"  {n}", style="dim"))
        if self.console.is_terminal:
            self.live = Live(self._render(), console=self.console, refresh_per_second=8, transient=True)
            self.live.start()

    def on_gate_start(self, gate: str) -> None:
        self.running = gate
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None
        self._refresh()

    def on_progress(self, done: int, total: int, text: str) -> None:
        if self.task is None:
            self.task = self.progress.add_task(escape(f"{self.running}: {text}"), total=total)
        self.progress.update(self.task, completed=done, total=total)
        if self.live is None and time.monotonic() - self._last_plain > 5 and total:
            self._last_plain = time.monotonic()
            self.console.print(f"  {self.running}: {done}/{total} {text}", markup=False)
        self._refresh()

    def on_gate_end(self, row: GateRow) -> None:
        self.rows.append(row)
        if row.gate in self.pending:
            self.pending.remove(row.gate)
        self.running = None
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None
        if self.live is None:
            v = row.verdict
            self.console.print(Text.assemble((f"{MARK[v]} ", STYLE[v]), (f"{gate_label(row):<18}", "bold"),
                                             (f"{v:<5}", STYLE[v]), f" {human_seconds(row.seconds):>8}  ",
                                             said(row)))
        self._refresh()

    # -- rendering ---------------------------------------------------------------
    def _render(self):
        return Group(gate_table(self.rows, self.pending, self.running, self.console.width), self.progress)

    def _refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._render())

    def finish(self, status: str, out_dir: Path, ledger: Path, ranks: Sequence[RankSummary] | None = None) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        self.console.print()
        self.console.print(gate_table(self.rows, width=self.console.width))
        if ranks:
            self.console.print()
            print_table(self.console, *rank_table(ranks, self.console.width))
        self.console.print()
        self.console.print(headline(self.rows, status))
        for r in self.rows:
            if r.verdict in (Verdict.FAIL, Verdict.WARN):
                v = r.verdict
                self.console.print(Text.assemble((f"  {MARK[v]} ", STYLE[v]), (gate_label(r, self.rows), "bold"),
                                                 f": {said(r)}"))
        self.console.print(Text(f"report {out_dir / 'report.json'} · ledger {ledger}", style="dim"))
