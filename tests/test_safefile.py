"""Files pilotrun did not just write are read bounded and typed (pilotrun/safefile.py): a FIFO, a link to
/dev/zero, a huge or deeply nested file, or the wrong shape is a named problem, never a hang, a MemoryError or a
traceback. In-process: the report's attachments and a program's event files."""
from __future__ import annotations

import json
import os
import threading

import pytest

from pilotrun.program.env import Role
from pilotrun.program.runner import read_rank_events
from pilotrun.report.html import _attachments
from pilotrun.safefile import FileKind, FileProblem, NonNegative, read_json

SELECTION_ROW = {"accelerator": "H100", "fits": True, "strategy": "ddp", "gpus": 8, "micro_batch_size": 4,
                 "grad_accum_steps": 2, "device_used_bytes": 1 << 30, "seconds_per_update": 1.5,
                 "cost_per_update": 0.01, "cost_for_planned_updates": 10.0, "software_stack": {"text": "cuda 12"}}


def _in_thread(fn, timeout: float = 10.0):
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    worker.start()
    worker.join(timeout)
    return worker, box


def test_the_reports_attachments_of_the_wrong_shape_a_fifo_or_a_device_are_said_not_raised(tmp_path):
    """Found trying `pilotrun report` as an attacker: a malformed selection.json said "no run ... in ledger", a
    TypeError exited 3, a FIFO hung."""
    sel = tmp_path / "selection.json"
    sel.write_text(json.dumps({"rows": [SELECTION_ROW]}))
    assert "Selection sheet" in _attachments(tmp_path) and "H100" in _attachments(tmp_path)
    for bad, said in ((json.dumps({"rows": [{**SELECTION_ROW, "accelerator": None}]}), "rows[0].accelerator is"),
                      (json.dumps({"rows": [{"fits": True}]}), "rows[0].accelerator is missing"),
                      (json.dumps({"rows": 5}), "rows is int, expected a list"),
                      (json.dumps({"rows": [{**SELECTION_ROW, "device_used_bytes": -5}]}), "expected a finite"),
                      ("[" * 100_000, "nested too deeply"), ("{oops", "not valid JSON")):
        sel.write_text(bad)
        page = _attachments(tmp_path)
        assert said in page and "left out of the report" in page and str(sel) in page, bad
    sel.unlink()
    sel.symlink_to("/dev/zero")
    assert "not a regular file" in _attachments(tmp_path)
    sel.unlink()
    os.mkfifo(sel)
    worker, box = _in_thread(lambda: _attachments(tmp_path))
    try:
        assert not worker.is_alive(), "a FIFO named selection.json hangs the report"
        assert "not a regular file" in box["value"]
    finally:
        if worker.is_alive():
            os.close(os.open(sel, os.O_WRONLY | os.O_NONBLOCK))


def test_event_files_of_no_rank_and_lines_that_are_not_events_are_named_and_left_out(tmp_path):
    """Found trying a program's events as an attacker: `<role>-rankfoo.jsonl` or a non-object line exited 3."""
    from pilotrun.program import env as E

    key = b"k" * E.KEY_BYTES
    good = {"kind": "update", "rank": 0, "writer": "w", "seq": 0, "update": 1, "loss": 1.0}
    second = {**good, "seq": 1, "update": 2}
    (tmp_path / "control-rank0.jsonl").write_text("\n".join([
        E.sign(key, json.dumps(good)), "[1]", '"text"', json.dumps({"kind": "stage", "row": "not a row"}),
        json.dumps({"kind": "update", "update": True}), "{not json", E.sign(key, json.dumps(second)), '{"cut'])
        + "\n")
    (tmp_path / "control-rankfoo.jsonl").write_text(E.sign(key, json.dumps(good)) + "\n")
    (tmp_path / f"control-rank{'9' * 200}.jsonl").write_text(E.sign(key, json.dumps(good)) + "\n")
    problems: list[str] = []
    events = read_rank_events(tmp_path, Role.CONTROL, problems, key)
    assert events == {0: [good, second]}
    assert sum("control-rankfoo.jsonl is not named" in p for p in problems) == 1
    assert sum("is not named <role>-rank<N>.jsonl" in p for p in problems) == 2
    for line in (2, 3, 4, 5, 6):
        assert any(f"line {line} " in p for p in problems), (line, problems)
    assert not any("line 8" in p for p in problems)  # the last line, cut by SIGKILL, is dropped quietly


def test_a_bounded_read_refuses_what_is_too_large_a_link_and_a_missing_file(tmp_path):
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(FileProblem) as info:
        read_json(big, 100)
    assert info.value.kind is FileKind.TOO_LARGE
    link = tmp_path / "link.json"
    link.symlink_to(big)
    with pytest.raises(FileProblem) as info:
        read_json(link, 1 << 20)
    assert info.value.kind is FileKind.NOT_REGULAR and "symbolic link" in str(info.value)
    assert read_json(link, 1 << 20, links=True)[0] == 0
    with pytest.raises(FileProblem) as info:
        read_json(tmp_path / "none.json", 10)
    assert info.value.kind is FileKind.MISSING
    with pytest.raises(FileProblem) as info:
        read_json(big, 1 << 20, {"peak": NonNegative()})
    assert info.value.kind is FileKind.WRONG_SHAPE and "list, expected a mapping" in str(info.value)


def test_a_ledger_that_fills_mid_run_records_the_end_beside_the_run_and_says_where(tmp_path, monkeypatch, capsys):
    """Found filling the disk under a pilot: sqlite3.OperationalError, exit 3, and the row lost. The disk is full
    for real as far as SQLite can tell: the ledger's page count is capped (max_page_count) once the run is in it,
    so the next row's INSERT fails with SQLite's own "database or disk is full"."""
    from pilotrun.cli import main
    from pilotrun.ledger.store import Ledger
    from tests.conftest import TEST_DIGEST, copy_fixture

    real = Ledger.add_gate_row

    def full_from_now_on(self, run_id, row, metrics=()):
        pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
        self.conn.execute(f"PRAGMA max_page_count = {pages}")
        return real(self, run_id, row, metrics)

    monkeypatch.setattr(Ledger, "add_gate_row", full_from_now_on)
    spec = copy_fixture("toy", tmp_path)
    code = main(["run", str(spec), "--gates", "lock", "--out", str(tmp_path / "out"), "--ledger",
                 str(tmp_path / "l.sqlite"), "--container-digest", TEST_DIGEST])
    err = capsys.readouterr().err
    fallback = tmp_path / "out" / "ledger-fallback.json"
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    flat = "".join(err.split())  # the console wraps at its width (another test in this process may have set it)
    assert "databaseordiskisfull" in flat and "ledger-fallback.json" in flat, err
    saved = json.loads(fallback.read_text())
    assert saved["status"] == "error" and [r["gate"] for r in saved["rows"]] == ["lock"]
    assert "database or disk is full" in saved["ledger_error"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["gates"][0]["gate"] == "lock"


def test_a_report_json_the_disk_refuses_is_a_named_error_with_the_free_space(tmp_path, monkeypatch):
    import errno

    from pilotrun.safefile import WriteFailed, write_atomic

    target = tmp_path / "report.json"
    target.write_text("old")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteFailed) as info:
        write_atomic(target, "new")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert "No space left on device" in str(info.value) and str(target) in str(info.value)
    assert "free there" in str(info.value)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_state_file_that_is_a_link_to_dev_zero_or_a_fifo_is_refused_without_reading_it(tmp_path):
    """step-N.expect.json linked to /dev/zero grew the restore worker to 21.5 GB."""
    from pilotrun.checkpoint.io import CheckpointError
    from pilotrun.checkpoint.state import load_state_json

    expect = tmp_path / "step-000004.expect.json"
    expect.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_state_json(expect, {"step": 4})
    expect.unlink()
    os.mkfifo(expect)
    worker, box = _in_thread(lambda: pytest.raises(CheckpointError, load_state_json, expect, {"step": 4}))
    try:
        assert not worker.is_alive(), "a FIFO as the fingerprints file hangs the restore worker"
        assert "not a regular file" in str(box["value"].value)
    finally:
        if worker.is_alive():
            os.close(os.open(expect, os.O_WRONLY | os.O_NONBLOCK))
