"""``pilotrun lock export|check``: a pilot's lock as a requirements file with exact versions, and whether an
environment holds one."""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from rich.markup import escape

from ..config.load import load_spec
from ..deploy.requirements import (
    Difference,
    Mismatch,
    NoTorchIndex,
    Target,
    Unpinnable,
    check,
    one_line,
    parse,
    python_of,
    requirements,
)
from ..ledger.records import RunKind, RunStatus
from ..lock import collect_lock, read_distributions
from ..safefile import FileProblem, read_bytes, read_json
from .common import (
    EXIT_GATE_FAILED,
    EXIT_OK,
    UsageError,
    add_ledger_arg,
    command_parser,
    err_console,
    ledger_if_present,
    out_console,
)

HELP = """examples:
  pilotrun lock export examples/tiny-sft/pilot.yaml -o requirements.lock.txt      # the last passed pilot's lock
  pilotrun lock export pilot.yaml --run tiny-sft-2026 --target cuda              # that run's lock, for a CUDA node
  pilotrun lock export pilot.yaml --target rocm --torch-index https://download.pytorch.org/whl/rocm6.4
  pilotrun lock check requirements.lock.txt                                       # exit 1 names what differs

export writes every distribution of the lock at its exact version, torch (and the builds tagged like it) from the
index of the target's runtime (--target: cpu, cuda or rocm; default the lock's own), and names what it leaves out
(pilotrun itself, installed from its source; a torch build's own runtime wheels). The lock is --run RUN's, else the
newest pilot of this spec's config that passed in the ledger, else this machine's environment (said so).
check: exit 0 when every pinned distribution (and the python in the file's header) is installed at its version,
1 when any differs or an installed distribution's metadata cannot be read (each named; the python is said apart,
not counted as a pin), 2 for a file that is not readable or not UTF-8 text."""


def add_parser(sub) -> None:
    p = command_parser(sub, "lock", __doc__, HELP)
    verbs = p.add_subparsers(dest="verb", metavar="export|check", parser_class=type(p))
    e = verbs.add_parser("export", help="the lock as a requirements file with exact versions", epilog=HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("spec")
    e.add_argument("--run", metavar="RUN", help="the run whose lock to export (default: the newest passed pilot of "
                                                "this spec's config in the ledger)")
    e.add_argument("--target", choices=[str(t) for t in Target],
                   help="the runtime the environment is for (default: the lock's own)")
    e.add_argument("--torch-index", metavar="URL", help="the index torch comes from (default: from the lock and "
                                                        "--target; ROCm needs it unless the lock ran on ROCm)")
    e.add_argument("-o", "--out", type=Path, help="write here (default: stdout)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add_ledger_arg(e)
    e.set_defaults(func=export_main)
    c = verbs.add_parser("check", help="whether this environment holds a requirements file's versions", epilog=HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("requirements", type=Path)
    c.set_defaults(func=check_main)
    p.set_defaults(func=lambda args: _no_verb(p))


def _no_verb(p) -> int:
    p.print_help()
    return 2


def proven_lock(spec, ledger_path: Path | None, ref: str | None) -> tuple[dict, str]:
    """(lock, where it came from): ``ref`` (a run id, or a lock.json file), else the newest pilot of the spec's
    config hash that passed (or only warned) in the ledger, else this machine's environment, said so."""
    if ref and Path(ref).is_file():
        try:
            return read_json(Path(ref), 64 << 20, schema={"versions": dict, "distributions": dict}), f"{ref}"
        except FileProblem as exc:
            raise UsageError(f"--lock/--run: {exc}; give a run id or a run's lock.json") from None
    led = ledger_if_present(ledger_path)
    try:
        if ref:
            run = led.run(ref) if led is not None else None
            if run is None or not run.get("lock_json"):
                raise UsageError(f"no run {ref!r} with a lock in {ledger_path or 'the ledger'}: give a run id "
                                 "(`pilotrun ledger`) or a lock.json file")
            return json.loads(run["lock_json"]), f"run {run['run_id']}"
        for run_id in (led.run_ids(RunKind.PILOT, spec.pilot_hash()) if led is not None else []):
            run = led.run(run_id)
            if run and run["status"] in (RunStatus.PASS, RunStatus.WARN) and run.get("lock_json"):
                return json.loads(run["lock_json"]), f"pilot {run_id} ({run['status']})"
    finally:
        if led is not None:
            led.close()
    return collect_lock(spec), (f"this machine's environment: no pilot of {spec.name} (config "
                                f"{spec.pilot_hash()[:8]}) passed in the ledger, so not proven by one")


def lock_target(lock: dict) -> Target:
    v = lock.get("versions") or {}
    return Target.ROCM if v.get("hip") else Target.CUDA if v.get("cuda") else Target.CPU


def export_main(args) -> int:
    spec = load_spec(args.spec, args.overrides, check_files=False)
    lock, source = proven_lock(spec, args.ledger, args.run)
    target = Target(args.target) if args.target else lock_target(lock)
    try:
        req = requirements(lock, target, source, args.torch_index)
    except NoTorchIndex as exc:
        raise UsageError(str(exc)) from None
    except Unpinnable as exc:
        raise UsageError(f"{exc} (the lock of {one_line(source)})") from None
    if args.out is None:
        sys.stdout.write(req.text)
    else:
        try:
            args.out.write_text(req.text)
        except OSError as exc:
            raise UsageError(f"-o {args.out}: cannot write it ({exc.strerror or exc})") from None
        out_console().print(f"wrote {escape(str(args.out))}: {len(req.pins)} pinned distribution(s) from "
                            f"{escape(source)}; {escape(str(req.torch))} ({escape(req.torch_from)})", highlight=False)
    if source.startswith("this machine"):
        err_console().print(f"[yellow]note[/]: {escape(source)}", highlight=False)
    return EXIT_OK


def check_main(args) -> int:
    try:
        text = read_bytes(args.requirements, 4 << 20).decode()
    except FileProblem as exc:
        raise UsageError(f"{exc}; give the file `pilotrun lock export` wrote") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{args.requirements} is not UTF-8 text (byte {exc.start}: {exc.reason}); give the file "
                         "`pilotrun lock export` wrote") from None
    pins = parse(text)
    if not pins:
        raise UsageError(f"{args.requirements} pins no distribution (NAME==VERSION lines); give the file "
                         "`pilotrun lock export` wrote")
    installed, unreadable = read_distributions()
    problems = check(pins, installed, python_of(text), platform.python_version())
    return _say_check(args.requirements, len(pins), problems, unreadable)


def _say_check(path: Path, n_pins: int, problems: list[Mismatch], unreadable: list[tuple[str, str]]) -> int:
    """Print what differs, each kind apart (pins counted as pins; the python and unreadable metadata said on their
    own); exit 0 when nothing does, else 1."""
    console = out_console()
    where = escape(one_line(path))
    pins = [p for p in problems if p.kind is Difference.PIN]
    python = [p for p in problems if p.kind is Difference.PYTHON]
    if not problems and not unreadable:
        console.print(f"lock check: this environment holds every one of the {n_pins} pinned distribution(s) of "
                      f"{where}", highlight=False)
        return EXIT_OK
    if pins:
        console.print(f"[bold red]lock check: {len(pins)} of {n_pins} pinned distribution(s) differ from this "
                      f"environment[/] ({where}):", highlight=False)
        for p in pins:
            console.print(f"  {escape(str(p))}", highlight=False)
    else:
        console.print(f"lock check: every one of the {n_pins} pinned distribution(s) of {where} is installed at its "
                      "version", highlight=False)
    for p in python:
        console.print(f"[bold red]lock check: python differs[/]: the file's header names {escape(p.pinned)}, this "
                      f"environment runs {escape(str(p.installed))} (not a pin: pip cannot install python; make the "
                      "venv with that python)", highlight=False)
    if unreadable:
        console.print(f"[bold red]lock check: {len(unreadable)} installed distribution(s) could not be read[/], so "
                      "whether they are what the file pins is unknown:", highlight=False)
        for file, why in unreadable:
            console.print(f"  {escape(one_line(file))}: {escape(why)}", highlight=False)
    return EXIT_GATE_FAILED
