"""The SQLite ledger: runs, gate rows, per-update metrics, notes."""
from .store import Ledger, LedgerError, default_ledger_path

__all__ = ["Ledger", "LedgerError", "default_ledger_path"]
