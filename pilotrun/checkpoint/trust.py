"""The one loading policy: what pilotrun may read from a checkpoint, an export or a DCP folder.

Every path that reads such a folder — ``run --resume``, the ``restore``/``resume``/``reload_eval``
workers, ``convert``, ``archive`` — admits it here first (:meth:`LoadPolicy.admit`), and the code
that would unpickle (``torch.distributed.checkpoint`` reads ``dcp/.metadata`` with ``pickle``)
asks :func:`require_known` right before it does. *Known* means the sha256 of the folder's
``manifest.json`` is recorded in the ledger (the save and export rows write it), so pilotrun
itself wrote exactly these bytes.

| what | known | unknown, ``--trust`` | unknown |
| --- | --- | --- | --- |
| every file against the manifest (size, sha256, plain file) | checked | checked | checked |
| ``.pt`` files | ``torch.load(weights_only=True)`` | ``weights_only=True`` | refused |
| ``dcp/.metadata`` (a pickle) | read by torch's DCP | refused | refused |
| the factory an ``export.json`` names | imported | only the one the user names | refused |

Source of the DCP row: torch/distributed/checkpoint/filesystem.py, ``FileSystemReader.read_metadata``
calls ``pickle.load`` (torch 2.x); no safe reader is attempted here, so unknown DCP folders are refused.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .io import MANIFEST, CheckpointError, folder_problems, read_manifest

if TYPE_CHECKING:
    from ..ledger.store import Ledger

DCP_METADATA = "dcp/.metadata"


class Refusal(str, enum.Enum):
    """Why a folder was not loaded: callers branch on this, never on the message."""

    DAMAGED = "damaged"            # a file differs from the manifest (named file by file)
    UNKNOWN = "unknown"            # the manifest is not recorded in the ledger and --trust was not given
    PICKLE = "pickle"              # loading would unpickle a file of an unknown folder (DCP metadata)
    FACTORY = "factory"            # an unknown export names a factory the user did not name
    OTHER_CONFIG = "other-config"  # written for another config hash (resume)


class LoadRefused(CheckpointError):
    """A folder the policy does not load; ``kind`` says why, ``problems`` lists each damaged file."""

    def __init__(self, kind: Refusal, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.problems = problems or []


def manifest_sha256(folder: Path) -> str:
    return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()


@dataclass(frozen=True)
class Admission:
    """A folder the policy let through: its manifest, the manifest's sha256, and whether the ledger knows it."""

    folder: Path
    manifest: dict
    manifest_sha256: str
    known: bool

    @property
    def layout(self) -> str:
        return str(self.manifest.get("layout") or "files")


# Folders admitted in this process, by resolved path: what require_known() consults right before unpickling.
_ADMITTED: dict[str, Admission] = {}


@dataclass(frozen=True)
class LoadPolicy:
    """``known``: manifest sha256s the ledger recorded; ``trust``: ``--trust`` (unknown may load, never
    unpickled); ``factory``: a factory the user named on the command line (``module:function``)."""

    known: frozenset[str] = field(default_factory=frozenset)
    trust: bool = False
    factory: str | None = None

    @classmethod
    def of(cls, known, trust: bool = False, factory: str | None = None) -> LoadPolicy:
        return cls(frozenset(known or ()), trust, factory)

    @classmethod
    def from_ledger(cls, ledger: Ledger, trust: bool = False, factory: str | None = None) -> LoadPolicy:
        return cls(frozenset(known_manifests(ledger)), trust, factory)

    def admit(self, folder: Path) -> Admission:
        """Check every file against the manifest, then the ledger; raise :class:`LoadRefused` or return the
        admission (registered for :func:`require_known`)."""
        folder = Path(folder)
        problems = folder_problems(folder)
        if problems:
            raise LoadRefused(Refusal.DAMAGED, f"{folder} is damaged: " + "; ".join(problems), problems)
        manifest = read_manifest(folder)
        digest = manifest_sha256(folder)
        adm = Admission(folder, manifest, digest, digest in self.known)
        if adm.layout == "dcp" and not adm.known:
            raise LoadRefused(Refusal.PICKLE, (
                f"{folder / DCP_METADATA} is a pickle (torch.distributed.checkpoint unpickles it) and this folder's "
                f"manifest (sha256 {digest[:12]}…) is not recorded in the ledger: pilotrun never unpickles an unknown "
                "file, --trust included; load it only with the ledger that recorded its save (--ledger)"))
        if not adm.known and not self.trust:
            raise LoadRefused(Refusal.UNKNOWN, (
                f"{folder}: its manifest (sha256 {digest[:12]}…) is not recorded in the ledger, so pilotrun did not "
                "write it (or it was edited since); pass --trust to load it anyway (still with weights_only=True, "
                "never unpickled), or point --ledger at the ledger that recorded it"))
        _ADMITTED[str(folder.resolve())] = adm
        return adm

    def export_factory(self, adm: Admission) -> str | None:
        """The factory to import for an admitted export (None: a Hugging Face folder, no factory).

        An unknown export's ``export.json`` may name any importable callable (``os:system``): it is imported
        only when the artifact is known or it is exactly the factory the user named."""
        meta = adm.folder / "export.json"
        if "export.json" not in adm.manifest["files"]:
            if self.factory is not None:
                return self.factory
            return None
        try:
            info = json.loads(meta.read_text())
            named = info["factory"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadRefused(Refusal.DAMAGED, f"{meta}: field 'factory' is unreadable ({type(exc).__name__}: "
                                               f"{exc})") from None
        if not isinstance(named, str):
            raise LoadRefused(Refusal.DAMAGED, f"{meta}: field 'factory' is not a 'module:function' string")
        if adm.known or (self.factory is not None and named == self.factory):
            return named
        who = f"you named {self.factory!r}" if self.factory else "no factory was named on the command line"
        raise LoadRefused(Refusal.FACTORY, (
            f"{meta} names the factory {named!r}, but this export's manifest (sha256 {adm.manifest_sha256[:12]}…) is "
            f"not recorded in the ledger and {who}: pilotrun imports nothing an unknown artifact names; load it with "
            "the ledger that recorded the export, or rebuild the model from your own spec's factory"))


def require_known(folder: Path) -> Admission:
    """Right before anything is unpickled from ``folder``: it was admitted as known in this process, and neither
    its manifest nor the DCP metadata changed since."""
    folder = Path(folder)
    adm = _ADMITTED.get(str(folder.resolve()))
    if adm is None or not adm.known:
        raise LoadRefused(Refusal.PICKLE, (
            f"{folder / DCP_METADATA} is a pickle and {folder} was not admitted as known (its manifest recorded in the "
            "ledger): pilotrun does not unpickle it"))
    if manifest_sha256(folder) != adm.manifest_sha256:
        raise LoadRefused(Refusal.DAMAGED, f"{folder / MANIFEST} changed after it was checked: not loaded")
    info = adm.manifest["files"].get(DCP_METADATA)
    meta = folder / DCP_METADATA
    if info is None or meta.is_symlink() or not meta.is_file() \
            or hashlib.sha256(meta.read_bytes()).hexdigest() != info["sha256"]:
        raise LoadRefused(Refusal.DAMAGED, f"{meta} is not the file its manifest lists: not loaded")
    return adm


def known_manifests(ledger: Ledger, run_id: str | None = None) -> set[str]:
    """sha256 of every checkpoint and export manifest the ledger recorded (the save and export rows)."""
    found = set()
    runs = [ledger.run(run_id)] if run_id else ledger.runs(limit=1_000_000)
    for run in runs:
        if run is None:
            continue
        for row in ledger.gate_rows(run["run_id"]):
            sha = (row.get("details") or {}).get("manifest_sha256")
            if isinstance(sha, str):
                found.add(sha)
    return found


def recorded_by(ledger: Ledger, manifest_sha: str | None = None, config_hash: str | None = None) -> list[dict]:
    """Runs that recorded a manifest, or ran a config hash: to say whose a foreign checkpoint is."""
    out = []
    for run in ledger.runs(limit=1_000_000):
        if config_hash is not None and run.get("config_hash") == config_hash:
            out.append(run)
        elif manifest_sha is not None and any((r.get("details") or {}).get("manifest_sha256") == manifest_sha
                                              for r in ledger.gate_rows(run["run_id"])):
            out.append(run)
    return out
