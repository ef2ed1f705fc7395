"""``program:``: the user's own training program, piloted as it is (README, "Pilot your own program").

With ``program:`` the spec needs only ``name``; ``model``, ``data`` and ``train`` become optional (the program
builds its own). ``pilot.resume.before`` / ``after`` are the N and K of the resume gate and ``pilot.resume.rtol``
its tolerance off bitwise.

Example::

    name: own-loop
    program:
      command: torchrun --standalone --nproc-per-node 2 train.py --updates 6
      files: [train.py]
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .paths import GlobRefused, path_value_problem, spec_glob
from .schema import doc

# The first words that name pilotrun's own interpreter (so the program runs with the packages pilotrun sees).
PYTHON_WORDS = ("python", "python3")
TORCHRUN_WORD = "torchrun"
# `accelerate launch ...` runs as python -m accelerate.commands.launch with pilotrun's interpreter, as torchrun does.
ACCELERATE_WORDS = ("accelerate", "launch")
TORCHRUN_MODULE, ACCELERATE_MODULE = "torch.distributed.run", "accelerate.commands.launch"
# `fabric run ...` (Lightning Fabric's CLI) as python -m lightning.fabric.cli, whose module runs the `run` command.
FABRIC_WORDS, FABRIC_MODULE = ("fabric", "run"), "lightning.fabric.cli"


@dataclass
class ProgramSpec:
    command: list[str] | str = doc(
        "the command line, a list or a string (split like a shell); run from the spec's folder; a first word "
        "python/python3, torchrun, `accelerate launch` or `fabric run` runs with pilotrun's own interpreter (torchrun "
        "as python -m torch.distributed.run, accelerate launch as python -m accelerate.commands.launch, fabric run as "
        "python -m lightning.fabric.cli)")
    files: list[str] | None = doc(
        "files (glob patterns, relative to the spec's folder) the lock hashes; default: the command's words that "
        "name existing files, the file of a module run with -m (python -m train: train.py), and the modules under "
        "the spec's folder those scripts import (found by reading them, without running them)", None)
    timeout: float = doc("seconds each run of the program may take before pilotrun kills its process group", 600.0)
    env: dict[str, str] | None = doc(
        "environment variables set for every run of the program (a campaign's program.env templates add to them); "
        "names starting with PILOTRUN_ are pilotrun's own", None)
    compare: Literal["auto", "bitwise", "rtol"] = doc(
        "how the resume gate compares runs: bitwise, within pilot.resume.rtol, or auto (bitwise when this machine has "
        "no accelerator, so the program ran on CPU; rtol otherwise)", "auto")

    @property
    def words(self) -> list[str]:
        return shlex.split(self.command) if isinstance(self.command, str) else list(self.command)

    def check(self):
        try:
            words = self.words
        except ValueError as exc:  # an unclosed quote
            yield "command", f"cannot split {self.command!r}: {exc}; close the quote or give a list"
            return
        if not words or not all(isinstance(w, str) and w for w in words):
            yield "command", "give the program's command line, e.g. 'python train.py' or a list of words"
        else:
            yield from _command_problems(words)
        if self.timeout <= 0:
            yield "timeout", f"must be positive, got {self.timeout}"
        yield from _env_problems(self.env or {})
        for i, pattern in enumerate(self.files or []):
            if isinstance(pattern, str) and (why := path_value_problem(pattern)) is not None:
                yield f"files[{i}]", why


# What one exec() takes: Linux refuses a single argument or NAME=value over 128 KiB (MAX_ARG_STRLEN) and all of them
# over ARG_MAX (E2BIG, an OSError from Popen); a NUL ends a C string (ValueError). Bounds far above any real command.
WORD_MAX = 32 << 10
COMMAND_MAX = 128 << 10
ENV_NAME_MAX = 255


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:40]!r}… ({len(text)} characters)"


def _command_problems(words: list[str]):
    """A word exec() cannot pass: a NUL byte, too long; or a command too long altogether."""
    for i, word in enumerate(words):
        if "\0" in word:
            yield "command", f"word {i + 1} contains a NUL byte, which no program argument may hold: {_shown(word)}"
        elif len(word) > WORD_MAX:
            yield "command", f"word {i + 1} is {len(word)} characters; an argument may be at most {WORD_MAX}"
    if sum(len(w) + 1 for w in words) > COMMAND_MAX:
        yield "command", (f"is {sum(len(w) + 1 for w in words)} characters; a command may be at most {COMMAND_MAX} "
                          "(put long settings in a file the program reads)")


def _env_problems(env: dict):
    """Names that are not variable names, pilotrun's own names, values exec() cannot pass."""
    for name, value in env.items():
        if not isinstance(name, str) or len(name) > ENV_NAME_MAX or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            shown = _shown(name) if isinstance(name, str) else repr(name)
            yield "env", f"{shown} is not an environment variable name (letters, digits, '_', at most {ENV_NAME_MAX})"
            continue
        if name.startswith("PILOTRUN_"):
            yield f"env.{name}", "is pilotrun's own (pilotrun/program/env.py sets it for each run); remove it"
        if not isinstance(value, str):
            yield f"env.{name}", f"must be a string (quote it in YAML), got {type(value).__name__}"
        elif "\0" in value:
            yield f"env.{name}", f"contains a NUL byte, which no environment variable may hold: {_shown(value)}"
        elif len(value) > WORD_MAX:
            yield f"env.{name}", f"is {len(value)} characters; a value may be at most {WORD_MAX}"


# Modules a `python -m` command launches ranks with, and the launcher whose arguments they take.
LAUNCHER_MODULES = {TORCHRUN_MODULE: "torchrun", "torch.distributed.launch": "torchrun",
                    ACCELERATE_MODULE: "accelerate"}
PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W")


def _launcher(words: list[str]) -> tuple[str | None, list[str]]:
    """("torchrun" | "accelerate" | None, the launcher's own words after its name)."""
    first = Path(words[0]).name if words else ""
    if first == TORCHRUN_WORD:
        return "torchrun", words[1:]
    if first == ACCELERATE_WORDS[0] and words[1:2] == [ACCELERATE_WORDS[1]]:
        return "accelerate", words[2:]
    if first.startswith(PYTHON_WORDS):
        i = 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-m":  # interpreter options: -u, -X opt
            i += 2 if words[i] in PYTHON_OPTIONS_WITH_VALUE else 1
        if words[i:i + 1] == ["-m"] and i + 1 < len(words) and words[i + 1] in LAUNCHER_MODULES:
            return LAUNCHER_MODULES[words[i + 1]], words[i + 2:]
    return None, []


def launcher_processes(words: list[str]) -> int | None:
    """How many processes the command's launcher starts on this machine, when its own words say so: torchrun (or
    ``python -m torch.distributed.run``) ``--nproc-per-node N``, ``accelerate launch --num_processes N`` (over
    ``--num_machines``). Read with the launcher's own argument parser, so the program's own arguments after its
    script are never taken for the launcher's. None for a plain ``python train.py``, or a count the launcher decides
    itself (``--nproc-per-node gpu``, accelerate's config file). A campaign gives each run that many devices."""
    import contextlib
    import io

    launcher, rest = _launcher(words)
    if launcher is None:
        return None
    with contextlib.redirect_stderr(io.StringIO()):  # a launcher's usage error is the program's, not ours
        try:
            if launcher == "torchrun":
                from torch.distributed.run import get_args_parser

                args, _ = get_args_parser().parse_known_args(rest)
                count = str(args.nproc_per_node)
            else:
                from accelerate.commands.launch import launch_command_parser

                args, _ = launch_command_parser().parse_known_args(rest)
                if args.num_processes is None:
                    return None
                count = str(int(args.num_processes) // max(1, int(args.num_machines or 1)))
        except (SystemExit, ImportError, ValueError, TypeError):
            return None
    return int(count) if count.isdigit() and int(count) > 0 else None


def script_words(words: list[str], folder: Path) -> list[str]:
    """The command's words that name existing files in ``folder`` (the script and its config files), and the file of
    a module run with ``-m`` (``python -m train`` → ``train.py``, a package's ``__main__.py``)."""
    out = []
    for before, word in zip(words, words[1:]):
        if word.startswith("-"):
            continue
        if (folder / word).is_file():
            out.append(word)
        elif before in ("-m", "--module"):
            # Found piloting `python -m mlp_train`: the lock hashed no file, so an edited script went unnoticed.
            base = word.replace(".", "/")
            out += [f for f in (f"{base}.py", f"{base}/__main__.py") if (folder / f).is_file()][:1]
    return out


def program_files(spec: ProgramSpec, folder: Path) -> tuple[list[Path], str]:
    """The files the lock hashes, and why these (the automatic choice says it)."""
    if spec.files is None:
        found = script_words(spec.words, folder)
        scripts = [folder / w for w in found]
        imported = local_imports([p for p in scripts if p.suffix == ".py"], folder)
        why = (f"program.files not given: the command's words naming files ({', '.join(found)})" if found
               else "program.files not given and the command names no file")
        if imported:
            cut = f"the first {LOCAL_IMPORTS_MAX} " if len(imported) >= LOCAL_IMPORTS_MAX else ""
            why += (f" and {cut}the local modules they import "
                    f"({', '.join(os.path.relpath(p, folder) for p in imported)})")
        return scripts + imported, why
    out: list[Path] = []
    passed: list[str] = []
    for pattern in spec.files:
        globbed = spec_glob(folder, pattern)
        out += globbed.files
        passed += [os.path.relpath(p, folder) for p in globbed.links_out if os.path.relpath(p, folder) not in passed]
    if passed:  # said in the lock: files under them are not the program's and are not hashed
        return out, f"program.files (links out of the spec's folder, not followed: {', '.join(passed)})"
    return out, "program.files"


# Enough for a program's own modules (nanoGPT: train.py imports model.py); a folder of hundreds is listed by hand.
LOCAL_IMPORTS_MAX = 64


def local_imports(scripts: list[Path], root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` that ``scripts`` import, and theirs in turn, as Python would find them: an
    absolute import (``import model``, ``from models.gpt import GPT``, a folder without ``__init__.py`` too) from the
    folders the scripts are run from (an entry script's own folder, and ``root`` for ``python -m``), a relative one
    (``from . import y``) from the importing file's package. Read with ``ast``, never run. Modules that are not under
    ``root`` (installed packages, the standard library) are not the program's; a file that does not parse adds none.
    At most LOCAL_IMPORTS_MAX, in the order they were found (the scripts' own imports first)."""
    import ast

    root_as_given, root = root, root.resolve()
    bases = list(dict.fromkeys([p.resolve().parent for p in scripts] + [root]))
    seen = {p.resolve() for p in scripts}
    queue: list[Path] = [p.resolve() for p in scripts]
    out: list[Path] = []
    while queue and len(out) < LOCAL_IMPORTS_MAX:
        script = queue.pop(0)
        try:
            tree = ast.parse(script.read_text(errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            names: list[tuple[str, int]] = []
            if isinstance(node, ast.Import):
                names = [(a.name, 0) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [(base, node.level)] + [(f"{base}.{a.name}" if base else a.name, node.level)
                                                for a in node.names]
            for name, level in names:
                for path in _module_files(name, level, script, bases, root):
                    if path not in seen and len(out) < LOCAL_IMPORTS_MAX:
                        seen.add(path)
                        out.append(path)
                        queue.append(path)
    # Named under root as given (the lock names files relative to the spec's folder, links and all).
    return [root_as_given / p.relative_to(root) for p in out]


def _module_files(name: str, level: int, script: Path, bases: list[Path], root: Path) -> list[Path]:
    """The files under ``root`` a module name resolves to (each regular package's ``__init__.py`` too)."""
    if level:
        starts = [script.parent]
        for _ in range(level - 1):
            starts = [starts[0].parent]
    else:
        starts = bases
    for start in starts:
        found = _walk_module(name.split(".") if name else [], start)
        if found is not None:
            return [p for p in found if p.is_relative_to(root)]
    return []


def _walk_module(parts: list[str], here: Path) -> list[Path] | None:
    """The files ``parts`` names from ``here``, or None when its first part is not there."""
    found: list[Path] = []
    for i, part in enumerate(parts):
        package, module = here / part, here / f"{part}.py"
        if package.is_dir():
            init = package / "__init__.py"
            if init.is_file():
                found.append(init.resolve())
            here = package  # a namespace package (no __init__.py) is a package too
        elif module.is_file():
            found.append(module.resolve())
            break
        else:
            return found if i else None
    return found


def program_file_problems(spec: ProgramSpec, folder: Path) -> list[tuple[str, str]]:
    """What cannot run: a pattern matching no file, a script named after python that does not exist."""
    problems = _files_problems(spec.files, folder)
    words = spec.words
    if not words:
        return problems
    if (module := _module_word(words)) is not None and not module_found(module, folder):
        # Found by the fuzzer: `python -m nosuchmod` passed the spec check and failed only at the first gate.
        problems.append(("program.command", f"no module {module!r} for `python -m` in {folder} nor on this "
                         "interpreter's sys.path (the program runs with pilotrun's own interpreter, from the spec's "
                         "folder); check the name, or install the package"))
    launcher = words[0] == TORCHRUN_WORD or tuple(words[:2]) in (ACCELERATE_WORDS, FABRIC_WORDS)
    if words[0] in PYTHON_WORDS or launcher:
        # python's script is its first plain word; a launcher's options take values, so its first word ending in .py
        if launcher:
            script = next((w for w in words[1:] if w.endswith(".py") and not w.startswith("-")), None)
        else:
            script = next((w for w in words[1:] if not w.startswith("-")), None)
        if "-m" not in words[1:3] and script is not None and script.endswith(".py") and not (folder / script).is_file():
            problems.append(("program.command", f"{script} not found in {folder} (the command runs from the spec's "
                             "folder)"))
    elif not _executable(words[0], folder):
        # Found piloting `command: trainme --fast`: Popen's FileNotFoundError surfaced as an internal error (exit 3).
        problems.append(("program.command", f"{words[0]!r} is not an executable file in {folder} nor a command on "
                         "PATH; start the command with python or torchrun (they run with pilotrun's interpreter), or "
                         "give the program's path relative to the spec's folder"))
    return problems


def _executable(word: str, folder: Path) -> bool:
    """Whether the command's first word runs: a path (relative to the spec's folder) to an executable file, or a
    name found on PATH (how Popen resolves it)."""
    if os.sep in word:
        path = folder / word
        return path.is_file() and os.access(path, os.X_OK)
    return shutil.which(word) is not None


def _files_problems(files: list[str] | None, folder: Path) -> list[tuple[str, str]]:
    """program.files: not empty, every pattern inside the spec's folder and matching a file there."""
    if files is None:
        return []
    if not files:  # found by the fuzzer: `files: []` was accepted and the lock hashed nothing
        return [("program.files", "is empty: the lock would hash no file and an edited program would go unnoticed; "
                 "list the program's files (e.g. [train.py]), or leave program.files out to hash the files its "
                 "command names")]
    problems = []
    root = folder.resolve()
    for i, pattern in enumerate(files):
        field = f"program.files[{i}]"
        try:
            found = spec_glob(folder, pattern)
        except GlobRefused as exc:  # absolute, '..', or a walk past its bounds: refused before any file is hashed
            problems.append((field, f"{exc}; the program's files are the ones beside its spec"))
            continue
        outside = [p for p in found.files if not p.resolve().is_relative_to(root)]
        if outside or found.named_out:  # a link to a file, or one the pattern's words lead through (lib/*.py)
            # Found by the fuzzer: ['/etc/passwd'] was hashed into the lock as one of the program's files.
            where = (f"{outside[0]}, a link" if outside else
                     f"{found.named_out[0]} links to {found.named_out[0].resolve()}, not followed")
            problems.append((field, f"{pattern!r} names a file outside the spec's folder {root} ({where}): the "
                             "program's files are the ones beside its spec; give a pattern relative to that folder"))
        elif not found.files:
            passed = f"; links out of the folder are not followed ({found.links_out[0]})" if found.links_out else ""
            problems.append((field, f"{pattern!r} matches no file in {folder} (patterns are relative to the spec's "
                             f"folder){passed}"))
    return problems


def _module_word(words: list[str]) -> str | None:
    """The module of ``python [options] -m MODULE ...``, or None when the command runs no module that way."""
    if words[0] not in PYTHON_WORDS:
        return None
    for before, word in zip(words[1:], words[2:]):
        if before == "-m":
            return word
        if not before.startswith("-"):  # a script: the words after it are its own
            return None
    return None


def module_found(name: str, folder: Path) -> bool:
    """Whether ``python -m name`` run from ``folder`` by this interpreter finds the module, found on the path as
    the import system would (``importlib.machinery.PathFinder``) without importing it or its parent packages:
    nothing of the program runs. Lenient where the program's path may differ: this interpreter's sys.path is
    searched too."""
    from importlib.machinery import PathFinder

    if not name or any(not part.isidentifier() for part in name.split(".")):
        return False
    if name in sys.modules:  # already imported here (os.path: set by os, found on no path)
        return True
    path: list[str] | None = [str(folder), *sys.path]
    for i, part in enumerate(name.split(".")):
        if i == 0 and part in sys.builtin_module_names:
            return len(name.split(".")) == 1
        found = PathFinder.find_spec(part, path)
        if found is None:
            return False
        path = list(found.submodule_search_locations or [])
        if not path and i < len(name.split(".")) - 1:
            return False  # a plain module has no submodules
    return True
