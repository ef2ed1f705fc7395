"""The ``pilotrun`` command: one module per subcommand, each a thin shell over pure functions.

Exit codes: 0 no gate failed · 1 a gate failed · 2 bad spec, file or usage ·
3 internal error (a pilotrun bug; the traceback is saved) · 130 Ctrl-C · 143 SIGTERM · 129 SIGHUP
(stopped by a signal: 128 + its number; see ``cli/common.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

from rich.markup import escape

from ..config.exitguard import ExitCalled, guard_os_exit
from ..config.schema import SpecError
from ..errors import ContainerDigestError, LaunchError
from ..interrupt import as_interrupted
from ..ledger.store import LedgerError
from ..procs import quiet_import_noise
from ..safefile import WriteFailed
from .common import COMMANDS, EXIT_BAD_INPUT, EXIT_INTERNAL, UsageError, err_console

EPILOG = """examples:
  pilotrun run examples/tiny-sft/pilot.yaml
  pilotrun run pilot.yaml --gates load,first_step,eval --set train.micro_batch_size=4
  pilotrun launch --nproc-per-node 2 pilot.yaml --set distributed.strategy=fsdp
  pilotrun inspect examples/tiny-sft/pilot.yaml -n 5
  pilotrun batch --micro-batch 2 --grad-accum 8 --replicas 1 --examples 3200
  pilotrun estimate examples/llama-7b-estimate/pilot.yaml --accelerator H100-80GB --gpus 4
  pilotrun select examples/llama-7b-estimate/pilot.yaml
  pilotrun plan examples/llama-7b-estimate/pilot.yaml --runs 6
  pilotrun plan examples/llama-7b-estimate/pilot.yaml --accelerator H100-80GB --skypilot task.yaml --bucket my-runs
  pilotrun lock export examples/tiny-sft/pilot.yaml -o requirements.lock.txt
  pilotrun campaign examples/campaign/lr-sweep.yaml --parallel 2
  pilotrun report lr-sweep-2026
  pilotrun note "kept the control: no variant beat it beyond seed spread"
  pilotrun archive lr-sweep-2026-r01
  pilotrun ledger
  pilotrun ledger --run tiny-sft-2026 --json
  pilotrun ledger --csv metrics --run lr-sweep-2026 --out metrics.csv

exit codes: 0 no gate failed, 1 a gate failed, 2 bad spec/file/usage, 3 internal error,
  130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (the run is recorded as interrupted; `run --resume` continues a pilot)"""

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default exits 2 with usage; keep 2, add the hint
        self.print_usage(sys.stderr)
        err_console().print(f"[bold red]error:[/] {escape(message)} (see {self.prog} --help)", highlight=False)
        raise SystemExit(EXIT_BAD_INPUT)


def command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (``pilotrun`` takes no option with a
    value before the command), when that word is a command; else None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command listed; only ``command``'s module is imported, for its flags.

    The other commands are stubs with their help line: enough for ``pilotrun --help`` and for argparse to name an
    unknown command, and they cost no import (``pilotrun ledger`` never loads torch)."""
    from .. import __version__

    parser = _Parser(prog="pilotrun",
                     description="Prove a PyTorch training job end to end, gate by gate, before renting GPUs.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pilotrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, summary in COMMANDS.items():
        if name == command:
            importlib.import_module(f"{__name__}.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    quiet_import_noise()  # torchao's import warnings (through transformers') are not the user's job's
    parser = build_parser(command_in(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        with guard_os_exit():  # user code's os._exit in this process raises ExitCalled (config/exitguard.py)
            return int(args.func(args) or 0)
    except SpecError as exc:
        console = err_console()
        where = f" in {escape(str(exc.source))}" if exc.source else ""
        console.print(f"[bold red]bad spec{where}[/] ({len(exc.problems)} "
                      f"problem{'s' if len(exc.problems) != 1 else ''}):")
        for field, message in exc.problems:
            # A problem with the whole file (missing, not YAML) has no field: its message names the file.
            console.print(f"  [bold]{escape(field)}[/]: {escape(message)}" if field else f"  {escape(message)}",
                          highlight=False)
        return EXIT_BAD_INPUT
    # WriteFailed: a report.json (or another file pilotrun writes) refused by a full disk: named, with the free space.
    except (UsageError, LedgerError, LaunchError, ContainerDigestError, WriteFailed) as exc:
        err_console().print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # a command that records its own stop (run, campaign) returns before this
        stop = as_interrupted(exc)
        err_console().print(f"[yellow]interrupted ({stop.how})[/]: rows written so far are in the ledger")
        return stop.exit_code
    except ExitCalled as exc:  # os._exit in user code outside any gate (a gate records it as a failed row)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/pilotrun/" not in f.filename]
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        err_console().print(f"[bold red]error:[/] user code called os._exit({exc.code!r}){where}; a factory must "
                            "return or raise an exception, never end the process", highlight=False)
        return EXIT_BAD_INPUT
    except SystemExit:
        raise
    except BrokenPipeError:  # `pilotrun ledger --csv metrics | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0
    except BaseException as exc:  # a bug in pilotrun, or a BaseException subclass (torch's CheckpointException)
        saved = _save_crash("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        err_console().print(f"[bold red]internal error[/]: {type(exc).__name__}: {escape(str(exc))}{escape(saved)}. "
                            "Please report it.", highlight=False)
        return EXIT_INTERNAL


def exit_code_for(exc: BaseException) -> int:
    """The exit code :func:`main` gives a command that raised ``exc`` (a node tells the others how it ended)."""
    if isinstance(exc, (SpecError, UsageError, LedgerError, LaunchError, ContainerDigestError, WriteFailed,
                        ExitCalled)):
        return EXIT_BAD_INPUT
    if isinstance(exc, KeyboardInterrupt):
        return as_interrupted(exc).exit_code
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    return EXIT_INTERNAL


def _save_crash(text: str) -> str:
    """Write a crash's traceback to runs/pilotrun-crash.txt, else to the temp folder; say where, or where not."""
    tried = []
    fallback = Path(tempfile.gettempdir()) / f"pilotrun-crash-{os.getpid()}.txt"
    for path in (Path("runs") / "pilotrun-crash.txt", fallback):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return f"; traceback saved to {path.resolve()}"
        except OSError as exc:
            tried.append(f"{path} ({exc.strerror or exc})")
    return f"; the traceback could not be written to {' nor '.join(tried)}"
