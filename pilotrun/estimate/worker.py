"""Run a fake-tensor trace in a fresh process, so a C++ abort cannot take the tool down.

    python -m pilotrun.estimate.worker --spec SPEC.json --result R.json [--target cuda] [--ac on|off]
        [--micro-batch N] [--seq-len L]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..config.spec import Spec
from ..workers.common import read_spec_file, write_error, write_result, write_spec_file


class TraceError(RuntimeError):
    """The trace process failed or crashed; the message says how and where its log is."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.estimate.worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--target", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ac", default="spec",
                    help="on (full), off, spec, or a policy: full, selective, selective-N, every-N")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16", "bf16-true"])
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
        write_error(args.result, exc)
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
            log = (folder / "trace.log").read_text(errors="replace")[-800:] if (folder / "trace.log").exists() else ""
            raise TraceError(f"{exc}{(': ' + log.strip().splitlines()[-1]) if log.strip() else ''}") from None


if __name__ == "__main__":
    sys.exit(main())
