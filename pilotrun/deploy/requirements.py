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


class Target(TextEnum):
    """The runtime the node's torch is built for (the catalog's ``stack``, or the CPU)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


class NoTorchIndex(ValueError):
    """The lock does not say which torch build the target needs and no index was given: the message says which flag."""


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
    pinned. ``source`` says whose lock it is, for the file's header."""
    dists = dict(lock.get("distributions") or {})
    versions = lock.get("versions") or {}
    torch_version = str(versions.get("torch") or dists.get("torch") or "")
    if not torch_version:
        raise NoTorchIndex("the lock records no torch version (versions.torch): not a pilotrun lock.json")
    url, tag, why = _torch_build(lock, target, index)
    _, proven_label = _split(torch_version)
    python = versions.get("python")
    lines = [f"# pilotrun lock export of {source}: every distribution at its exact version.",
             "# pip install -r THIS_FILE, then `pilotrun lock check THIS_FILE` says whether the environment holds it.",
             f"# python: {python}" if python else "# python: unknown (the lock records no versions.python)",
             f"# torch for {target}: {why}"]
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
    return Requirements("\n".join(lines) + "\n", python, torch_pin, url, why, left_out)


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


@dataclass(frozen=True)
class Mismatch:
    name: str
    pinned: str
    installed: str | None  # None: not installed

    def __str__(self) -> str:
        return f"{self.name}: pinned {self.pinned}, " + (f"installed {self.installed}" if self.installed
                                                         else "not installed")


def check(pins: dict[str, str], installed: dict[str, str], python: str | None = None,
          python_now: str | None = None) -> list[Mismatch]:
    """Every pin the environment does not hold (and python, when both are given). Distributions installed beyond
    the pins are not mismatches: the target's torch brings its own runtime (the lock gate names them)."""
    out = []
    if python and python_now and python != python_now:
        out.append(Mismatch("python", python, python_now))
    for name, version in sorted(pins.items()):
        have = installed.get(name)
        if have != version:
            out.append(Mismatch(name, version, have))
    return out
