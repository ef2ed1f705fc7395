"""Data: built-in JSONL tasks, user factories, splits by leakage unit."""
from .bundle import DataBundle, build_data
from .jsonl import DataError

__all__ = ["DataBundle", "DataError", "build_data"]
