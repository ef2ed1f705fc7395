"""What every worker shares: the spec it rebuilds from a file, its peaks, and the result it writes back.

Workers build their job with :mod:`pilotrun.drivers.build`, exactly as the pilot's own process does.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.load import spec_from_mapping
from ..config.spec import Spec

if TYPE_CHECKING:
    import torch


def write_spec_file(spec: Spec, path: Path) -> Path:
    """What a worker needs to rebuild exactly this spec: the mapping as written (overrides included)."""
    path.write_text(json.dumps({"source": spec.source, "written": spec.written}))
    return path


def read_spec_file(path: str | Path, check_files: bool = True) -> Spec:
    """The spec a parent wrote; ``check_files=False`` for workers that read no data file or tokenizer (the trace)."""
    payload = json.loads(Path(path).read_text())
    return spec_from_mapping(payload["written"], payload["source"], check_files=check_files)


def peak_memory(device: torch.device) -> dict:
    """This process's peaks, for the gate row (children report their own memory)."""
    mem: dict[str, int | None] = {"host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                  * (1 if sys.platform == "darwin" else 1024)}
    from .. import backends  # here, not at the top: a process that only supervises a program never imports torch

    rt = backends.for_device(device)
    if rt.allocator_counts:  # elsewhere no peak is kept outside a meter (its tracker counts inside one only)
        mem["peak_allocated_bytes"] = rt.peak_allocated(device).value
        mem["peak_reserved_bytes"] = rt.peak_reserved(device).value
    return mem


def write_result(path: str | Path, payload: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, path)


def write_error(path: str | Path, exc: BaseException, **fields) -> None:
    """A worker's exception as its result file says it: the parent names ``error`` in its row and keeps the
    traceback's tail (call inside the ``except``)."""
    write_result(path, {**fields, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]})
