"""Tables readable where people read them (issue 46, item 6): every table of ``select``, ``plan``, ``estimate``,
``ledger`` and the run summary keeps one line per row at 80, 120 and 200 columns, no line wider than the console.

At 120 and 200 nothing in a table is cut ("…"); at 80 whole columns may be left out, in each table's declared order,
and a line under the table names them; long per-row notes (a software stack, an assumption) are "[n]" footnotes."""
from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from pilotrun.ledger import Ledger
from pilotrun.ledger.records import GateRow, RunStatus
from pilotrun.pilot.report import rank_summary
from pilotrun.ui.console import MARK, ConsoleObserver
from pilotrun.ui.tables import Column, Footnotes, fit_table
from tests.conftest import pilotrun_cli, write_spec

WIDTHS = (80, 120, 200)
SHAPE = {
    "name": "shape-only",
    "model": {"config": {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}},
    "data": {"task": "causal-lm", "max_length": 64},
    "train": {"micro_batch_size": 2, "grad_accum_steps": 2, "updates": 20, "optimizer": {"lr": 1e-4}},
}


def table_rows(out: str, header: str, firsts: list[str], width: int) -> list[str]:
    """The lines of the table whose header line starts with ``header``: exactly one line per row, each starting with
    its first cell (``firsts``, in order), and the line after it is not a row's continuation."""
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width, out
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = lines[at + 1: at + 1 + len(firsts)]
    assert [r.split("  ")[0].strip() for r in rows] == firsts, out
    after = lines[at + 1 + len(firsts):][:1]
    assert not after or not after[0].startswith(" "), out  # a wrapped cell would continue under its column
    if width >= 120:
        # Nothing cut by rich; "… [n]" is a long note's first words and its footnote's mark.
        assert not re.search(r"…(?! \[\d+\])", "\n".join(lines[at: at + 1 + len(firsts)])), out
    return rows


def left_out(out: str, width: int) -> list[str]:
    lines = out.splitlines()
    at = next((i for i, x in enumerate(lines) if x.startswith(f"left out at {width} columns: ")), None)
    if at is None:
        return []
    line = lines[at].rstrip()
    for more in lines[at + 1:]:  # a long list wraps at the console's width before its "(...)"
        if " (" in line:
            break
        line += " " + more.strip()
    return line.split(": ", 1)[1].split(" (")[0].split(", ")


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    return write_spec(tmp_path_factory.mktemp("tables") / "pilot.yaml", SHAPE)


@pytest.mark.process  # the trace runs in a fresh interpreter
@pytest.mark.parametrize("width", WIDTHS)
def test_the_selection_sheet_has_one_line_per_accelerator(spec_path, width):
    cwd = spec_path.parent
    rows = json.loads(pilotrun_cli("select", str(spec_path), "--json", cwd=cwd).stdout)["rows"]
    res = pilotrun_cli("select", str(spec_path), cwd=cwd, env={"COLUMNS": str(width)})
    assert res.returncode == 0, res.stderr
    lines = table_rows(res.stdout, "accelerator", [r["accelerator"] for r in rows], width)
    # The stack is a footnote: each distinct text once, numbered, under the table.
    stacks = list(dict.fromkeys(r["software_stack"]["text"] for r in rows))
    assert all(line.rstrip().endswith(f"[{stacks.index(r['software_stack']['text']) + 1}]")
               for line, r in zip(lines, rows, strict=True)), res.stdout
    text = " ".join(res.stdout.split())
    assert all(f"[{n}] {s}" in text for n, s in enumerate(stacks, 1)), res.stdout
    dropped = left_out(res.stdout, width)
    header = res.stdout.splitlines()[next(i for i, x in enumerate(res.stdout.splitlines()) if x.startswith("acc"))]
    assert not any(f"  {d}  " in f"  {header}  " for d in dropped)
    if width == 200:
        assert dropped == []
    else:  # what always stays: which accelerator, whether and how it fits, the time
        for col in ("accelerator", "fits", "strategy", "GPUs", "mb x accum", "time/update", "20 updates", "stack"):
            assert col in header, res.stdout
    if width == 80:
        assert dropped, res.stdout


@pytest.mark.process
@pytest.mark.parametrize("width", WIDTHS)
def test_estimate_and_plan_tables_keep_one_line_per_row(spec_path, width):
    cwd, env = spec_path.parent, {"COLUMNS": str(width)}
    accs = ["--accelerator", "H100-80GB", "--accelerator", "MI300X-192GB"]
    report = json.loads(pilotrun_cli("estimate", str(spec_path), *accs, "--json", cwd=cwd).stdout)
    res = pilotrun_cli("estimate", str(spec_path), *accs, cwd=cwd, env=env)
    assert res.returncode == 0, res.stderr
    table_rows(res.stdout, "stage ", ["first_step", "steady_step", "eval", "save"], width)
    table_rows(res.stdout, "accelerator", [f["accelerator"] for f in report["fits"]], width)
    plan = json.loads(pilotrun_cli("plan", str(spec_path), accs[0], accs[1], "--json", cwd=cwd).stdout)
    res = pilotrun_cli("plan", str(spec_path), accs[0], accs[1], cwd=cwd, env=env)
    assert res.returncode == 0, res.stderr
    items = [i["item"] for i in plan["accelerators"][0]["per_run"]["items"]] + ["one run"]
    table_rows(res.stdout, "item", items, width)


@pytest.mark.process  # COLUMNS is read when the process starts: a real subprocess
def test_ledger_runs_keep_one_line_each(tmp_path):
    path = tmp_path / "l.sqlite"
    ids = [f"a-rather-long-job-name-20261204-0{k}5243-abcd" for k in range(3)]
    with Ledger(path) as led:
        for k, run_id in enumerate(ids):
            # The first was stopped by SIGTERM and continued by the second: the longest status there is.
            led.start_run(run_id, "a-rather-long-job-name", "pilot", parent_id=ids[0] if k == 1 else None,
                          meta={"interrupted_by": "SIGTERM"} if k == 0 else None)
            for gate, verdict in (("load", "pass"), ("inspect", "warn"), ("eval", "fail"), ("export", "skip")):
                led.add_gate_row(run_id, GateRow.now(gate, verdict, "x " * 40, seconds=1.0 + k))
            led.end_run(run_id, RunStatus.INTERRUPTED if k == 0 else RunStatus.FAIL)
    for width in WIDTHS:
        res = pilotrun_cli("ledger", "--ledger", str(path), cwd=tmp_path, env={"COLUMNS": str(width)})
        assert res.returncode == 0, res.stderr
        table_rows(res.stdout, "run ", ids[::-1], width)
        # Whole somewhere: in its cell, or cut there and whole in its footnote.
        assert f"interrupted (SIGTERM); continued by {ids[1]}" in " ".join(res.stdout.split()), res.stdout
        assert (left_out(res.stdout, width) != []) is (width == 80), res.stdout


def _gate(gate: str, verdict: str, rank: int, peak: int, reason: str) -> dict:
    return {"gate": gate, "verdict": verdict, "rank": rank, "seconds": 2.0 + 3 * rank, "reason": reason,
            "memory": {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak * 2, "host_rss_peak_bytes": 2**31}}


@pytest.mark.parametrize("width", WIDTHS)
def test_the_run_summary_keeps_one_line_per_gate(tmp_path, width):
    rows = [_gate(g, v, rank, (1 + rank) * 2**30, f"{g}: " + "a long reason with many words " * 5)
            for g, v in (("load", "pass"), ("accum_equivalence", "warn"), ("steady_step", "fail"))
            for rank in (0, 1)]
    ranks = rank_summary([GateRow.from_mapping(r) for r in rows])
    assert ranks[0].imbalance  # the rank table has its long note
    out = io.StringIO()
    observer = ConsoleObserver(Console(file=out, width=width, color_system=None))
    observer.rows = [GateRow.from_mapping(r) for r in rows]
    observer.finish("fail", tmp_path, tmp_path / "ledger.sqlite", ranks)
    text = out.getvalue()
    gates = [f"{r['gate']} [rank {r['rank']}]" for r in rows]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["gate", "verdict"])
    shown = lines[at + 1: at + 1 + len(gates)]
    # One line per gate: its mark, its label, and a reason of at least a stub (at 80, ranks in the labels and the
    # reserved column leave too little room: host RSS and reserved are left out, not every row cut by rich).
    assert [line[0] for line in shown] == [MARK[r["verdict"]] for r in rows], text
    assert [line[1:].strip().split("  ")[0] for line in shown] == gates, text
    assert all(line.split("  ")[-1].strip().startswith(r["reason"][:10]) for line, r in zip(shown, rows, strict=True)), text
    assert ("host RSS" in lines[at]) is (width > 80), text
    assert not lines[at + 1 + len(gates)].strip(), text
    table_rows(text, "gate ", ["load", "accum_equivalence", "steady_step"], width)
    # The imbalance whole: in its cell where the table fits so (200), else cut there and whole in footnote [1].
    imbalance = "memory differs across ranks by 100%; time differs across ranks by 150%"
    assert (f"[1] {imbalance}" in text) is (width < 200) and imbalance in text, text


def test_footnotes_number_each_long_text_once_and_keep_short_ones():
    notes = Footnotes(limit=10)  # too narrow for words: the mark alone
    assert [notes.cell(t) for t in ("short", "a long note here", "another long one", "a long note here")] == [
        "short", "[1]", "[2]", "[1]"]
    assert notes.lines() == ["[1] a long note here", "[2] another long one"]
    notes = Footnotes(limit=24)  # the first whole words that fit, then the mark
    cell = notes.cell("20 updates x 1.2 s (each op at 70% of its peak)")
    assert cell == "20 updates x 1.2 s… [1]" and len(cell) <= 24
    assert notes.cell("x" * 30) == "x" * 19 + "… [2]" and notes.lines()[1] == "[2] " + "x" * 30


def test_fit_table_leaves_out_columns_in_their_order_until_it_fits():
    cols = (Column("name"), Column("a", drop=1), Column("b", drop=2), Column("c", drop=1))
    rows = [["x" * 20, "a" * 20, "b" * 20, "c" * 20]]
    assert fit_table(cols, rows, 200)[1] == []
    assert fit_table(cols, rows, 70)[1] == ["b"]
    assert fit_table(cols, rows, 48)[1] == ["b", "c"]
    table, dropped = fit_table(cols, rows, 10)  # nothing left to leave out: one line, cut
    assert dropped == ["a", "b", "c"]
    out = io.StringIO()
    Console(file=out, width=10, color_system=None).print(table)
    assert [len(line) for line in out.getvalue().splitlines()] == [10, 10] and "…" in out.getvalue()
