"""Shared by the subcommands: the command table, exit codes, consoles, errors that become exit 2."""
from __future__ import annotations

import argparse
import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from ..config.ids import ID_MAX, id_problem

EXIT_OK, EXIT_GATE_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
# Stopped by a signal: 128 + its number, the shell's convention (pilotrun.interrupt.Interrupted.exit_code).
# 130 Ctrl-C (SIGINT) · 143 SIGTERM (preemption, `timeout`, schedulers) · 129 SIGHUP (a closed SSH session).
# `pilotrun run` records the pilot as interrupted, naming the signal; `--resume` continues it.
EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_HANGUP = 130, 143, 129


# Each subcommand: its name (its module is pilotrun/cli/<name>.py) and its one-line help. `pilotrun` imports only
# the module of the command it runs (cli/__init__.py), so `pilotrun --help`, `ledger` or `note` start without torch
# and the training stack; adding a command is its module and a line here.
COMMANDS: dict[str, str] = {
    "run": "run the pilot's gates on a spec",
    "launch": "run the pilot on several processes (torchrun)",
    "inspect": "show examples as the loss sees them",
    "batch": "examples-per-update arithmetic",
    "estimate": "predict memory and time on accelerators you do not have",
    "select": "the selection sheet: accelerator, strategy, sizes and time",
    "plan": "pipeline budget and 3/7/30-day rental plans",
    "variants": "run the memory fixes beside the control and measure them",
    "campaign": "run a control and variants over seeds",
    "report": "write a self-contained HTML report",
    "note": "attach a note to a run or campaign",
    "archive": "pack a run or a whole campaign into a .tar.gz",
    "ledger": "list runs and gate rows",
    "lock": "export a lock as a requirements file; check an environment against one",
    "convert": "a distributed checkpoint as one .pt or .safetensors file",
}


def command_parser(sub, name: str, doc: str | None, epilog: str) -> argparse.ArgumentParser:
    """The subparser of command ``name``: its help line from COMMANDS, the module's docstring and examples."""
    return sub.add_parser(name, help=COMMANDS[name], description=doc, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


class UsageError(Exception):
    """Bad input that is not a spec problem (missing file, unknown run id, bad flag value): exit 2."""


def id_arg(limit: int = ID_MAX) -> Callable[[str], str]:
    """The argparse ``type`` of a flag that takes an identifier (``--run-id``, ``--task-id``, ``--name``): the one rule
    (``config.ids``), so a run id never becomes ``runs/../../x``; argparse's error names the flag, exit 2."""
    def identifier(value: str) -> str:
        if (why := id_problem(value, limit)) is not None:
            raise argparse.ArgumentTypeError(why)
        return value
    return identifier


# Logs and pipes are not 80 columns wide; without a terminal, do not squeeze tables.
PIPE_WIDTH = 160


def console_for(stderr: bool) -> Console:
    """A console as wide as the terminal; without one, as wide as ``COLUMNS`` says, else PIPE_WIDTH."""
    console = Console(stderr=stderr)  # rich reads COLUMNS itself on a terminal
    if not console.is_terminal:
        columns = os.environ.get("COLUMNS", "")
        console = Console(stderr=stderr, width=int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH)
    return console


@functools.cache
def err_console() -> Console:
    return console_for(True)


def out_console() -> Console:
    return console_for(False)


def writable_folder(path: Path, what: str) -> None:
    """Create ``path`` (with its parents) and prove a file can be written there; UsageError (exit 2) naming it
    otherwise: a file, a folder under a file, a read-only mount, /proc."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what}: {p} is a file, not a folder; give a folder (it is created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".pilotrun-write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(p) else ""
        raise UsageError(f"{what}: cannot write in {p}{where}: {exc.strerror or exc}; "
                         "choose a writable folder") from None
    except Exception as exc:  # e.g. a path the filesystem refuses to name (NUL bytes: ValueError)
        raise UsageError(f"{what}: cannot use {p!s}: {exc}") from None


LEDGER_HELP = "ledger file (default runs/ledger.sqlite, or $PILOTRUN_LEDGER)"


def add_ledger_arg(p, why: str = "") -> None:
    """The one ``--ledger`` flag every subcommand shares."""
    p.add_argument("--ledger", type=Path, help=LEDGER_HELP + (f"; {why}" if why else ""))


def existing_ledger(args) -> Path:
    """The ``--ledger`` path (or the default), which must exist: reading commands never create one."""
    from ..ledger.store import default_ledger_path

    path = Path(getattr(args, "ledger", None) or default_ledger_path())
    if not path.exists():
        raise UsageError(f"no ledger at {path}: run a pilot or a campaign first, or pass --ledger")
    return path


def ledger_if_present(path: Path | None):
    """The ledger (``--ledger`` or the default) when the file exists, else None: estimates read it, never create it."""
    from ..ledger.store import Ledger, default_ledger_path

    path = Path(path or default_ledger_path())
    return Ledger(path) if path.exists() else None
