"""Run a fake-tensor trace in a fresh process, so a C++ abort cannot take the tool down.

    python -m pilotrun.estimate.worker --spec SPEC.json --result R.json [--target cuda] [--ac on|off]
        [--micro-batch N] [--seq-len L]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..config.sections import PRECISIONS
from ..config.spec import Spec
from ..errors import is_internal
from ..workers.common import read_spec_file, write_error, write_result, write_spec_file


class TraceError(RuntimeError):
    """The trace process failed or crashed on the job it was given; the message says how and where its log is."""


class TraceCrash(RuntimeError):
    """pilotrun's own code failed in the trace process (a bug, not the job's fault): not a TraceError, so a command
    ends with exit 3 and its traceback saved instead of blaming the spec; the message names the kept log."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.estimate.worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--target", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ac", default="spec",
                    help="on (full), off, spec, or a policy: full, selective, selective-N, every-N")
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--seq-len", type=int)
    args = ap.parse_args(argv)
    try:
        from ..models.quiet import QuietTransformers
        from .trace import trace_job

        # The trace synthesises built-in inputs: a shape alone is enough (data file and tokenizer may not exist yet).
        spec = read_spec_file(args.spec, check_files=False)
        if args.precision:
            spec.train.precision = args.precision
        ac: bool | str | None = {"spec": None, "on": True, "off": False}.get(args.ac, args.ac)
        with QuietTransformers():
            result = trace_job(spec, target=args.target, activation_checkpointing=ac,
                               micro_batch_size=args.micro_batch, seq_len=args.seq_len)
        write_result(args.result, result.to_dict())
        return 0
    except Exception as exc:
        write_error(args.result, exc, internal=is_internal(exc))
        return 1


def trace_in_subprocess(spec: Spec, target: str = "cuda", ac: bool | str | None = None, precision: str | None = None,
                        micro_batch: int | None = None, seq_len: int | None = None, timeout: float = 1800) -> dict:
    """The trace as a dict (see TraceResult), computed in a child interpreter."""
    from ..workers.launch import WorkerError, run_worker

    with tempfile.TemporaryDirectory(prefix="pilotrun-trace-") as tmp:
        folder = Path(tmp)
        spec_file = write_spec_file(spec, folder / "spec.json")
        said = "spec" if ac is None else "on" if ac is True else "off" if ac is False else ac
        args = ["--spec", str(spec_file), "--target", target, "--ac", said]
        if precision:
            args += ["--precision", precision]
        if micro_batch:
            args += ["--micro-batch", str(micro_batch)]
        if seq_len:
            args += ["--seq-len", str(seq_len)]
        try:
            return run_worker("pilotrun.estimate.worker", args, folder / "result.json", folder / "trace.log",
                              "trace", timeout=timeout)
        except WorkerError as exc:
            raise _failure(exc, folder) from None


def _failure(exc: Exception, folder: Path) -> TraceError | TraceCrash:
    """The trace's failure, its log (with the worker's traceback) kept where it outlives the temporary folder and
    named instead of it: TraceCrash for pilotrun's own bug, TraceError for the job's."""
    log = folder / "trace.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    payload: dict = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads((folder / "result.json").read_text())
        payload = loaded if isinstance(loaded, dict) else {}
    kept = _keep_log(text + (f"\n{payload['traceback']}" if payload.get("traceback") else ""))
    said = str(exc).replace(str(log), kept)
    if payload.get("internal"):
        return TraceCrash(f"{said}: pilotrun's own code failed while tracing (a bug in pilotrun, not in the spec)")
    tail = text[-800:].strip()
    return TraceError(f"{said}{(': ' + tail.splitlines()[-1]) if tail else ''}")


def _keep_log(text: str) -> str:
    """Write a failed trace's log beside the trace cache (the message is read after the temporary folder is gone);
    its path, or why it could not be kept."""
    from .cache import default_dir

    folder = default_dir().parent / "logs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, dest = tempfile.mkstemp(prefix=f"trace-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log", dir=folder)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    except OSError as exc:
        return f"not kept: {folder}: {exc.strerror or exc}"
    return dest


if __name__ == "__main__":
    from ..procs import quiet_import_noise

    quiet_import_noise()  # torchao's import warnings (through transformers') are not this job's
    sys.exit(main())
