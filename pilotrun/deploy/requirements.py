"""A lock as a requirements file: every distribution at its exact version, torch from the index of the target's
runtime, and the check that an environment holds those versions.

:func:`requirements` is a function from a lock (``lock.json``) to the text of a pip requirements file, usable on its
own (``pip install -r``) and by a SkyPilot task's setup; :func:`check` compares a file's pins with the installed
distributions. Neither installs or prints anything.

Example::

    req = requirements(lock, Target.CUDA, source="lock.json of pilot tiny-sft-2026...")
    Path("requirements.lock.txt").write_text(req.text)
    problems = check(parse(req.text), installed_distributions(), platform.python_version())
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.version import VERSION_PATTERN

from ..ledger.records import TextEnum

TORCH_INDEX = "https://download.pytorch.org/whl/"
# The torch build's own runtime libraries: the target's torch wheel pins its own (a CPU lock has none, a CUDA lock's
# nvidia-* would be wrong for ROCm), so they are left to it and named in the file.
RUNTIME_PACKAGE = re.compile(r"^(nvidia-.+|triton|pytorch-triton(-.+)?)$")
# Distributions that no package index serves: the task installs them from their source.
FROM_SOURCE = ("pilotrun",)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")
PYTHON_LINE = re.compile(r"^# python: (\S+)\s*$")
TAG = re.compile(r"^(cpu|cu\d+|rocm\d+(\.\d+)*)$")
# The grammars a value from a lock must meet before it is written into a requirements file (which pip reads, options
# included) or a shell script: a lock.json is a file anyone can edit, so a version could be `--index-url URL`.
NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")            # PEP 508's distribution name
VERSION = re.compile(VERSION_PATTERN, re.VERBOSE | re.IGNORECASE)              # PEP 440 (fullmatch: no whitespace)
PYTHON = re.compile(r"^\d+\.\d+(\.\d+)?((a|b|rc)\d+)?\+?$")                    # platform.python_version()
# An index URL pip reads as one option argument: no whitespace or quotes (pip splits option lines as a shell does),
# no $ (pip expands ${VAR}), printable ASCII only.
INDEX_URL = re.compile(r"^(https?|file)://[A-Za-z0-9._~:/?#\[\]@!&()*+,;=%-]+$")
# What Python's str.splitlines and YAML take for a line break, and the other control characters.
NOT_ONE_LINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


class Target(TextEnum):
    """The runtime the node's torch is built for (the catalog's ``stack``, or the CPU)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


class NoTorchIndex(ValueError):
    """The lock does not say which torch build the target needs and no index was given: the message says which flag."""


class Unpinnable(ValueError):
    """A value of the lock (or --torch-index) that does not meet its grammar, so it cannot be written as a
    requirements line: the message names the field and the value (escaped)."""


def one_line(text: object) -> str:
    """``text`` with every line break and control character written as its escape (``\\n``): a value quoted in a
    comment line of a requirements file or a script, which it can then not end."""
    return NOT_ONE_LINE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def checked_lock(lock: dict, index: str | None = None) -> None:
    """Raise :class:`Unpinnable` naming the first value of ``lock`` (or ``index``) outside its grammar: versions.python
    and versions.torch, and each distribution's name (PEP 508) and version (PEP 440)."""
    if index is not None and not INDEX_URL.match(index):
        raise Unpinnable(f"--torch-index {one_line(repr(index))} is not an index URL (http://, https:// or file://, no "
                         "spaces or quotes): give the index's URL, e.g. https://download.pytorch.org/whl/rocm6.4")
    versions = lock.get("versions") or {}
    python = versions.get("python")
    if python is not None and not (isinstance(python, str) and PYTHON.match(python)):
        raise Unpinnable(f"the lock's versions.python is {one_line(repr(python))}, not a python version (3.11.7): "
                         "give the lock.json a pilot wrote")
    torch = versions.get("torch")
    if torch and not (isinstance(torch, str) and VERSION.fullmatch(torch)):
        raise Unpinnable(f"the lock's versions.torch is {one_line(repr(torch))}, not a PEP 440 version: give the "
                         "lock.json a pilot wrote")
    for name, version in (lock.get("distributions") or {}).items():
        if not (isinstance(name, str) and NAME.match(name)):
            raise Unpinnable(f"the lock's distributions has a name {one_line(repr(name))}, not a distribution name "
                             "(PEP 508: letters, digits, '.', '_', '-'): give the lock.json a pilot wrote")
        if not (isinstance(version, str) and VERSION.fullmatch(version)):
            raise Unpinnable(f"the lock's distributions.{name} is {one_line(repr(version))}, not a PEP 440 version: "
                             "a requirements line pins NAME==VERSION; give the lock.json a pilot wrote")


@dataclass
class Requirements:
    text: str
    python: str | None
    torch: str | None                  # the pinned torch requirement ("torch==2.13.0+cu128")
    index: str | None                  # the extra index torch comes from (None: the default index, PyPI)
    torch_from: str                    # why that build
    left_out: list[str] = field(default_factory=list)  # "name version: why", one per distribution not pinned

    @property
    def pins(self) -> dict[str, str]:
        return parse(self.text)


def _split(version: str) -> tuple[str, str | None]:
    base, _, label = version.partition("+")
    return base, (label or None)


def _torch_build(lock: dict, target: Target, index: str | None) -> tuple[str | None, str | None, str]:
    """(index URL or None for PyPI, local label or None, why) of the torch the target needs."""
    versions = lock.get("versions") or {}
    _, label = _split(str(versions.get("torch") or ""))
    proven_on = ("ROCm " + str(versions["hip"]) if versions.get("hip") else
                 "CUDA " + str(versions["cuda"]) if versions.get("cuda") else "the CPU")
    if index:
        tag = index.rstrip("/").rsplit("/", 1)[-1]
        return index, (tag if TAG.match(tag) else None), f"--torch-index {index}"
    same_stack = {Target.CUDA: bool(versions.get("cuda")) and not versions.get("hip"),
                  Target.ROCM: bool(versions.get("hip")), Target.CPU: not versions.get("cuda")}[target]
    if same_stack and label:  # proven on this runtime, from a torch index: the same index
        return TORCH_INDEX + label, label, f"the index of the proven build, torch {versions['torch']} on {proven_on}"
    if same_stack:
        return None, None, f"the default index (PyPI), as the proven torch {versions.get('torch')} on {proven_on}"
    if target == Target.CUDA:
        return None, None, (f"proven on {proven_on} (torch {versions.get('torch')}); for CUDA the same version from "
                            "PyPI, whose Linux wheel is torch's default CUDA build (--torch-index chooses another)")
    if target == Target.CPU:
        return TORCH_INDEX + "cpu", "cpu", f"proven on {proven_on}; for the CPU, torch's cpu index"
    raise NoTorchIndex(f"the lock was proven on {proven_on} (torch {versions.get('torch')}), which does not say which "
                       "ROCm build of torch the node needs: pass --torch-index "
                       f"{TORCH_INDEX}rocmX.Y (the ROCm version the node's driver supports)")


def requirements(lock: dict, target: Target, source: str, index: str | None = None) -> Requirements:
    """The lock's distributions pinned exactly, torch (and the builds tagged like it: torchvision, torchaudio) from
    the target's index; pilotrun (installed from its source) and the torch build's runtime libraries named, not
    pinned. ``source`` says whose lock it is, for the file's header. Raises :class:`Unpinnable` for a value outside
    its grammar (:func:`checked_lock`), :class:`NoTorchIndex` when the target's torch build is unknown."""
    checked_lock(lock, index)
    dists = dict(lock.get("distributions") or {})
    versions = lock.get("versions") or {}
    torch_version = str(versions.get("torch") or dists.get("torch") or "")
    if not torch_version:
        raise NoTorchIndex("the lock records no torch version (versions.torch): not a pilotrun lock.json")
    url, tag, why = _torch_build(lock, target, index)
    _, proven_label = _split(torch_version)
    python = versions.get("python")
    lines = [f"# pilotrun lock export of {one_line(source)}: every distribution at its exact version.",
             "# pip install -r THIS_FILE, then `pilotrun lock check THIS_FILE` says whether the environment holds it.",
             f"# python: {python}" if python else "# python: unknown (the lock records no versions.python)",
             f"# torch for {target}: {one_line(why)}"]
    if url:
        lines.append(f"--extra-index-url {url}")
    pins, left_out, torch_pin = [], [], None
    for name, version in sorted(dists.items()):
        if name in FROM_SOURCE:
            left_out.append(f"{name} {version}: installed from its source, not from an index")
            continue
        if RUNTIME_PACKAGE.match(name):
            left_out.append(f"{name} {version}: the torch build's own runtime; the target's torch wheel pins its own")
            continue
        base, label = _split(str(version))
        if proven_label and label == proven_label:  # built for the proven runtime, like torch: the target's build
            version = base + (f"+{tag}" if tag else "")
        pins.append(f"{name}=={version}")
        if name == "torch":
            torch_pin = pins[-1]
    if torch_pin is None:  # a lock with torch in versions but not in distributions (torch from a path)
        base, _ = _split(torch_version)
        torch_pin = f"torch=={base}" + (f"+{tag}" if tag else "")
        pins.insert(0, torch_pin)
    lines += pins
    if left_out:
        lines += ["# not pinned here:"] + [f"#   {x}" for x in left_out]
    return Requirements(_only_pins("\n".join(lines) + "\n"), python, torch_pin, url, why, left_out)


def _only_pins(text: str) -> str:
    """``text``, once every line is shown to be a comment, a pin or the one index option written above: a value that
    got past :func:`checked_lock` is a fault in this module (exit 3), never a pip option."""
    for line in text.split("\n"):
        name, pinned, version = line.partition("==")
        ok = (not line or (line.startswith("#") and not NOT_ONE_LINE.search(line))
              or (bool(pinned) and bool(NAME.match(name)) and bool(VERSION.fullmatch(version)))
              or (line.startswith("--extra-index-url ") and bool(INDEX_URL.match(line.split(" ", 1)[1]))))
        if not ok:
            raise AssertionError(f"requirements: a line that is not a comment, a pin or the index: {line!r}")
    return text


def parse(text: str) -> dict[str, str]:
    """The ``name==version`` pins of a requirements file (names normalised as the lock writes them)."""
    out = {}
    for line in text.splitlines():
        m = PIN.match(line.strip())
        if m:
            out[normalise(m.group(1))] = m.group(2)
    return out


def python_of(text: str) -> str | None:
    """The python version the file's header names (``# python: 3.11.7``), or None."""
    for line in text.splitlines():
        m = PYTHON_LINE.match(line)
        if m and m.group(1) != "unknown":
            return m.group(1)
    return None


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Difference(TextEnum):
    """What a :class:`Mismatch` is: a pinned distribution, or the python the file's header names (pip cannot
    install python, so it is no pin and is not counted among them)."""

    PIN = "pin"
    PYTHON = "python"


@dataclass(frozen=True)
class Mismatch:
    name: str
    pinned: str
    installed: str | None  # None: not installed
    kind: Difference = Difference.PIN

    def __str__(self) -> str:
        return f"{self.name}: pinned {self.pinned}, " + (f"installed {self.installed}" if self.installed
                                                         else "not installed")


def check(pins: dict[str, str], installed: dict[str, str], python: str | None = None,
          python_now: str | None = None) -> list[Mismatch]:
    """Every pin the environment does not hold (and python, when both are given, as a :attr:`Difference.PYTHON`).
    Distributions installed beyond the pins are not mismatches: the target's torch brings its own runtime (the lock
    gate names them)."""
    out = []
    if python and python_now and python != python_now:
        out.append(Mismatch("python", python, python_now, Difference.PYTHON))
    for name, version in sorted(pins.items()):
        have = installed.get(name)
        if have != version:
            out.append(Mismatch(name, version, have))
    return out
