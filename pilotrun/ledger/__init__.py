"""The SQLite ledger: runs, gate rows, per-update metrics, notes; and the types its rows hold."""
from .records import GateRow, RunEnd, RunKind, RunStatus, Series, StopKind, Verdict
from .store import Ledger, LedgerError, default_ledger_path

__all__ = ["GateRow", "Ledger", "LedgerError", "RunEnd", "RunKind", "RunStatus", "Series", "StopKind", "Verdict",
           "default_ledger_path"]
