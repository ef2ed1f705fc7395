"""The ledger: one SQLite file that keeps every run, gate row, per-update metric and note.

Rows are written in transactions (``BEGIN IMMEDIATE``), so a killed pilot leaves
complete rows only; WAL mode and a busy timeout let several processes (ranks,
parallel campaign runs) write to one file without losing or duplicating rows.
Rows are never updated in place except a run's end status.

Kinds, statuses, verdicts and stop kinds are the enums of :mod:`pilotrun.ledger.records`,
where each value is documented; the columns below keep their text.

Example::

    with Ledger("runs/ledger.sqlite") as led:
        for run in led.runs(): print(run["run_id"], run["status"])
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .records import GateRow, RunEnd, RunKind, RunStatus, Series, now

SCHEMA_VERSION = 1


def _meta_field(name: str) -> str:
    """A field of ``meta_json`` as an SQL expression: indexed below, and the lookups use the same text so SQLite uses
    the index. ``json_valid`` first: a row whose meta is not JSON (a hand-edited ledger) indexes as NULL, where
    ``json_extract`` alone would fail the index's creation and every later write."""
    return f"(CASE WHEN json_valid(meta_json) THEN json_extract(meta_json, '$.{name}') END)"


# The lookups a restart makes (``--task-id``: the runs a task started; a campaign's runs; a spec's pilots by config
# hash) are indexed: a ledger of many thousand rows answers them without reading every row. Expression indexes on
# meta_json, not new columns: an existing ledger gets them on its next open (CREATE INDEX IF NOT EXISTS, no
# migration), and rows another pilotrun version writes are indexed by SQLite itself.
TASK_ID = _meta_field("task_id")
CAMPAIGN_ID = _meta_field("campaign_id")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    kind        TEXT NOT NULL,            -- records.RunKind: pilot | stage | campaign | campaign-run
    spec_path   TEXT,
    out_dir     TEXT,
    config_hash TEXT,
    lock_json   TEXT,
    status      TEXT NOT NULL,            -- records.RunStatus: running; pilots pass | warn | fail | error |
                                          -- interrupted; campaign runs planned | finished | diverged | failed |
                                          -- stopped | not-run | refused; campaigns finished | finished-with-stops
                                          -- | interrupted
    started_at  TEXT NOT NULL,
    ended_at    TEXT,
    parent_id   TEXT,                     -- the run this one resumes, retries or continues
    meta_json   TEXT                      -- campaign runs: variant, seed, stop_kind (records.StopKind),
                                          -- stop_reason, stopped_at, final
);
CREATE TABLE IF NOT EXISTS gate_rows (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    gate        TEXT NOT NULL,
    verdict     TEXT NOT NULL CHECK (verdict IN ('pass', 'warn', 'fail', 'skip')),
    reason      TEXT NOT NULL,
    inputs_json TEXT NOT NULL,
    memory_json TEXT NOT NULL,
    seconds     REAL,
    rank        INTEGER NOT NULL DEFAULT 0,
    world_size  INTEGER NOT NULL DEFAULT 1,
    started_at  TEXT NOT NULL,
    ended_at    TEXT NOT NULL,
    details_json TEXT
);
CREATE TABLE IF NOT EXISTS metrics (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    gate        TEXT NOT NULL,            -- the gate that measured the point (pilots), or the series of a
                                          -- campaign run (records.Series: train | val)
    rank        INTEGER NOT NULL DEFAULT 0,
    step        INTEGER NOT NULL,
    loss        REAL,
    lr          REAL,
    grad_norm   REAL,
    examples    INTEGER,
    tokens      INTEGER,
    seconds     REAL,
    data_wait_s REAL,
    sample_ids_json TEXT,
    extra_json  TEXT
);
CREATE TABLE IF NOT EXISTS notes (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT REFERENCES runs(run_id),
    at     TEXT NOT NULL,
    text   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS gate_rows_run ON gate_rows(run_id);
CREATE INDEX IF NOT EXISTS metrics_run ON metrics(run_id, gate, step);
CREATE INDEX IF NOT EXISTS runs_name ON runs(name, started_at);
CREATE INDEX IF NOT EXISTS runs_name_kind ON runs(name, kind, started_at);
CREATE INDEX IF NOT EXISTS runs_task ON runs(name, kind, """ + TASK_ID + """, started_at);
CREATE INDEX IF NOT EXISTS runs_campaign ON runs(kind, """ + CAMPAIGN_ID + """);
CREATE INDEX IF NOT EXISTS runs_config ON runs(kind, config_hash);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_id);
"""

DEFAULT_LEDGER = Path("runs") / "ledger.sqlite"


class LedgerError(Exception):
    """The ledger file cannot be opened or is not a pilotrun ledger."""


class LedgerWriteFailed(LedgerError):
    """A write to the ledger failed (a full disk, a quota, a read-only or vanished file): the message names the file
    and SQLite's words; the pilot then records its end in a fallback file beside the run."""

    def __init__(self, path: Path, cause: str) -> None:
        free = ""
        try:
            free = f"; {shutil.disk_usage(Path(path).parent).free / 2**20:.1f} MiB free there"
        except OSError:
            pass
        super().__init__(f"cannot write the ledger {path}: {cause}{free}")
        self.path, self.cause = Path(path), cause


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def default_ledger_path() -> Path:
    return Path(os.environ.get("PILOTRUN_LEDGER", str(DEFAULT_LEDGER)))


def _merge_meta(cur: sqlite3.Cursor, run_id: str, fields: dict) -> None:
    """Inside a write transaction: read the run's meta and write it back with ``fields`` set, so another
    process merging its own fields in between cannot be overwritten."""
    row = cur.execute("SELECT meta_json FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    meta = {**json.loads((row["meta_json"] if row else None) or "{}"), **fields}
    cur.execute("UPDATE runs SET meta_json = ? WHERE run_id = ?", (_json(meta), run_id))


def _retry_locked(statement, wait_s: float = 60.0):
    """Run a statement that SQLite refuses with "locked" without consulting the busy timeout, until it succeeds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return statement()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _insert_metrics(cur: sqlite3.Cursor, run_id: str, gate: str, rank: int, points: Iterable[dict]) -> None:
    for m in points:
        cur.execute(
            "INSERT INTO metrics (run_id, gate, rank, step, loss, lr, grad_norm, examples, tokens, seconds,"
            " data_wait_s, sample_ids_json, extra_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, gate, rank, m["step"], m.get("loss"), m.get("lr"), m.get("grad_norm"), m.get("examples"),
             m.get("tokens"), m.get("seconds"), m.get("data_wait_s"), _json(m.get("sample_ids", [])),
             _json(m.get("extra", {}))),
        )


class Ledger:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_ledger_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only working directory with the default ledger, /proc, a file in the way
            raise LedgerError(f"cannot create {self.path.parent} for the ledger {self.path}: {exc.strerror or exc}; "
                              "pass --ledger or set $PILOTRUN_LEDGER to a writable path") from None
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=60, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA busy_timeout = 60000")
            # Switching a fresh file to WAL takes an exclusive lock and SQLite answers "locked" at once instead of
            # waiting in the busy handler, so two ranks opening a new ledger together would fail ~1 time in 10.
            _retry_locked(lambda: self.conn.execute("PRAGMA journal_mode = WAL"))
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self.conn.execute("PRAGMA foreign_keys = ON")
            self._init_schema()
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path} is not a usable SQLite ledger ({exc}); "
                              "move it aside or pass --ledger") from None

    def _init_schema(self) -> None:
        # executescript commits on its own; the statements are idempotent.
        _retry_locked(lambda: self.conn.executescript(SCHEMA))
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            with self.transaction() as cur:
                cur.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row["value"]) > SCHEMA_VERSION:
            raise LedgerError(f"{self.path} was written by a newer pilotrun (schema {row['value']}); upgrade pilotrun")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Cursor]:
        cur = self.conn.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                if self.conn.in_transaction:
                    cur.execute("ROLLBACK")
                raise
            else:
                cur.execute("COMMIT")
        except sqlite3.OperationalError as exc:  # "database or disk is full", "disk I/O error", read-only
            if self.conn.in_transaction:
                try:
                    cur.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise LedgerWriteFailed(self.path, str(exc)) from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writes ---------------------------------------------------------------
    def start_run(self, run_id: str, name: str, kind: RunKind | str, *, spec_path: str | None = None,
                  out_dir: str | None = None, config_hash: str | None = None, lock: dict | None = None,
                  parent_id: str | None = None, meta: dict | None = None) -> None:
        with self.transaction() as cur:
            cur.execute(
                "INSERT INTO runs (run_id, name, kind, spec_path, out_dir, config_hash, lock_json, status, started_at,"
                " parent_id, meta_json) VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?)",
                (run_id, name, str(RunKind(kind)), spec_path, out_dir, config_hash,
                 _json(lock) if lock is not None else None,
                 now(), parent_id, _json(meta or {})),
            )

    def set_lock(self, run_id: str, lock: dict) -> None:
        with self.transaction() as cur:
            cur.execute("UPDATE runs SET lock_json = ? WHERE run_id = ?", (_json(lock), run_id))

    def claim(self, run_id: str, expected: RunStatus, status: RunStatus, meta: dict | None = None) -> bool:
        """Move a run from ``expected`` to ``status`` (merging ``meta``) unless another process got there first."""
        with self.transaction() as cur:
            cur.execute("UPDATE runs SET status = ? WHERE run_id = ? AND status = ?",
                        (str(RunStatus(status)), run_id, str(RunStatus(expected))))
            if cur.rowcount != 1:
                return False
            if meta:
                _merge_meta(cur, run_id, meta)
            return True

    def set_status(self, run_id: str, status: RunStatus) -> None:
        """A status that is not an end (planned, running)."""
        with self.transaction() as cur:
            cur.execute("UPDATE runs SET status = ? WHERE run_id = ?", (str(RunStatus(status)), run_id))

    def end_run(self, run_id: str, status: RunStatus) -> None:
        with self.transaction() as cur:
            cur.execute("UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?",
                        (str(RunStatus(status)), now(), run_id))

    def add_gate_row(self, run_id: str, row: GateRow | Mapping[str, Any], metrics: Iterable[dict] = ()) -> int:
        """One gate row and its per-update metrics, in one transaction (a mapping is checked as a :class:`GateRow`)."""
        r = (row if isinstance(row, GateRow) else GateRow.from_mapping(row)).to_dict()
        with self.transaction() as cur:
            cur.execute(
                "INSERT INTO gate_rows (run_id, gate, verdict, reason, inputs_json, memory_json, seconds, rank,"
                " world_size, started_at, ended_at, details_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, r["gate"], r["verdict"], r["reason"], _json(r["inputs"]), _json(r["memory"]), r["seconds"],
                 int(r["rank"]), int(r["world_size"]), r["started_at"], r["ended_at"], _json(r["details"])),
            )
            row_id = cur.lastrowid
            _insert_metrics(cur, run_id, r["gate"], int(r["rank"]), metrics)
        return int(row_id or 0)

    def add_metrics(self, run_id: str, series: Series, points: Iterable[dict], rank: int = 0) -> None:
        """Per-update points of a campaign run's series, in one transaction (no gate row: they are not a gate)."""
        with self.transaction() as cur:
            _insert_metrics(cur, run_id, str(Series(series)), rank, points)

    def finish_campaign_run(self, run_id: str, end: RunEnd, **fields: Any) -> None:
        """A campaign run's end: its status, why it stopped and where, and ``fields`` (final, first_loss) in meta."""
        with self.transaction() as cur:
            _merge_meta(cur, run_id, {**end.fields(), **fields})
            cur.execute("UPDATE runs SET status = ?, ended_at = ? WHERE run_id = ?", (str(end.status), now(), run_id))

    def merge_meta(self, run_id: str, fields: dict) -> None:
        """Set some meta fields, keeping the rest, atomically against other writers."""
        with self.transaction() as cur:
            _merge_meta(cur, run_id, fields)

    def plan_runs(self, runs: Iterable[dict]) -> None:
        """Many planned runs (``start_run``'s keywords each, ``run_id``, ``name`` and ``kind`` among them; no lock:
        a run's lock is taken when it starts, ``set_lock``) in one transaction, each with status ``planned``: a
        campaign of thousands of runs writes its plan at once, and a reader sees all of it or none."""
        with self.transaction() as cur:
            cur.executemany(
                "INSERT INTO runs (run_id, name, kind, spec_path, out_dir, config_hash, status, started_at, parent_id,"
                " meta_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(r["run_id"], r["name"], str(RunKind(r["kind"])), r.get("spec_path"), r.get("out_dir"),
                  r.get("config_hash"), str(RunStatus.PLANNED), now(), r.get("parent_id"), _json(r.get("meta") or {}))
                 for r in runs])

    def campaign_runs(self, campaign_id: str) -> list[dict]:
        """The runs of a campaign (retries included), in the order they were planned (an indexed lookup)."""
        rows = []
        for r in self.conn.execute(f"SELECT * FROM runs WHERE kind = ? AND {CAMPAIGN_ID} = ? ORDER BY rowid",
                                   (str(RunKind.CAMPAIGN_RUN), campaign_id)):
            meta = json.loads(r["meta_json"] or "{}")
            if meta.get("campaign_id") == campaign_id:  # what the index said, read back from the row
                rows.append({**dict(r), "meta": meta})
        return rows

    def set_meta(self, run_id: str, meta: dict) -> None:
        with self.transaction() as cur:
            cur.execute("UPDATE runs SET meta_json = ? WHERE run_id = ?", (_json(meta), run_id))

    def add_note(self, run_id: str | None, text: str) -> None:
        with self.transaction() as cur:
            cur.execute("INSERT INTO notes (run_id, at, text) VALUES (?, ?, ?)", (run_id, now(), text))

    # -- reads ----------------------------------------------------------------
    def runs(self, name: str | None = None, limit: int = 50, kind: RunKind | str | None = None) -> list[dict]:
        """The newest ``limit`` runs (of this name, of this kind), newest first."""
        where = [(c, v) for c, v in (("name", name), ("kind", str(RunKind(kind)) if kind else None)) if v]
        q = ("SELECT * FROM runs" + (" WHERE " + " AND ".join(f"{c} = ?" for c, _ in where) if where else "")
             + " ORDER BY started_at DESC, rowid DESC LIMIT ?")
        return [dict(r) for r in self.conn.execute(q, (*(v for _, v in where), limit))]

    def task_runs(self, name: str, kind: RunKind | str, task_id: str) -> list[dict]:
        """The runs of this name and kind that the task ``task_id`` started (``meta.task_id``), newest first: an
        indexed lookup, however many other runs the name has (a campaign's runs carry its base spec's name)."""
        return [dict(r) for r in self.conn.execute(
            f"SELECT * FROM runs WHERE name = ? AND kind = ? AND {TASK_ID} = ? ORDER BY started_at DESC, rowid DESC",
            (name, str(RunKind(kind)), task_id))]

    def has_run(self, run_id: str) -> bool:
        """Whether a run with exactly this id is in the ledger (no prefix matching: a node registering a run)."""
        return self.conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is not None

    def run_ids(self, kind: RunKind | str, config_hash: str) -> list[str]:
        """The ids of the runs of this kind and config hash, newest first (started later; of two started in the
        same millisecond, the one added later)."""
        return [r["run_id"] for r in self.conn.execute(
            "SELECT run_id FROM runs WHERE kind = ? AND config_hash = ? ORDER BY started_at DESC, rowid DESC",
            (str(RunKind(kind)), config_hash))]

    def run(self, run_id: str) -> dict | None:
        """The run with this id or unique prefix (as git accepts a unique prefix); LedgerError when ambiguous."""
        found = self.matches(run_id)
        if len(found) > 1:
            ids = ", ".join(x["run_id"] for x in found[:5])
            raise LedgerError(f"{run_id!r} matches {len(found)} runs ({ids}{', ...' if len(found) > 5 else ''}); "
                              "give more of the id")
        return found[0] if found else None

    def matches(self, ref: str) -> list[dict]:
        """The runs ``ref`` may mean, newest first: the run with exactly that id, else every run whose id starts
        with it, less the runs of a matched campaign (``<campaign>-rNN``), which their campaign's id stands for."""
        r = self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (ref,)).fetchone()
        if r is not None:
            return [dict(r)]
        rows = [dict(x) for x in self.conn.execute(
            "SELECT * FROM runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY started_at DESC, rowid DESC",
            (ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",))]
        ids = [x["run_id"] for x in rows]
        return [x for x in rows if not any(x["run_id"] != o and x["run_id"].startswith(o) for o in ids)]

    def children(self, run_id: str) -> list[str]:
        """Runs that continue or retry ``run_id`` (their parent_id)."""
        return [r["run_id"] for r in self.conn.execute("SELECT run_id FROM runs WHERE parent_id = ?", (run_id,))]

    def gate_rows(self, run_id: str) -> list[dict]:
        out = []
        for r in self.conn.execute("SELECT * FROM gate_rows WHERE run_id = ? ORDER BY id", (run_id,)):
            d = dict(r)
            for key in ("inputs", "memory", "details"):
                d[key] = json.loads(d.pop(f"{key}_json") or "{}")
            out.append(d)
        return out

    def gate_records(self, run_id: str) -> list[GateRow]:
        """The run's gate rows, typed (what code outside the ledger reads; :meth:`gate_rows` is the JSON form)."""
        return [GateRow.from_mapping(r) for r in self.gate_rows(run_id)]

    def metrics(self, run_id: str, gate: str | None = None) -> list[dict]:
        q = "SELECT * FROM metrics WHERE run_id = ?" + (" AND gate = ?" if gate else "") + " ORDER BY rank, step, id"
        out = []
        for r in self.conn.execute(q, (run_id, gate) if gate else (run_id,)):
            d = dict(r)
            d["sample_ids"] = json.loads(d.pop("sample_ids_json") or "[]")
            d["extra"] = json.loads(d.pop("extra_json") or "{}")
            out.append(d)
        return out

    def notes(self, run_id: str | None = None) -> list[dict]:
        q = "SELECT * FROM notes" + (" WHERE run_id = ?" if run_id else "") + " ORDER BY id"
        return [dict(r) for r in self.conn.execute(q, (run_id,) if run_id else ())]

    def previous_lock(self, name: str, before_run: str) -> tuple[str, dict] | None:
        """The most recent other run of this name that recorded a lock."""
        for r in self.conn.execute(
            "SELECT run_id, lock_json FROM runs WHERE name = ? AND run_id != ? AND lock_json IS NOT NULL"
            " ORDER BY started_at DESC, rowid DESC LIMIT 1",
            (name, before_run),
        ):
            return r["run_id"], json.loads(r["lock_json"])
        return None
