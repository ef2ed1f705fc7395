"""The one loading policy: what pilotrun may read from a checkpoint, an export or a DCP folder.

Every path that reads such a folder — ``run --resume``, the ``restore``/``resume``/``reload_eval``
workers, ``convert``, ``archive`` — admits it here first (:meth:`LoadPolicy.admit`), then reads it
through :func:`pilotrun.checkpoint.pinned.pinned`: a private view in which every file is the one whose
digest was checked, so a file swapped after the check is never used. The code that would unpickle
(``torch.distributed.checkpoint`` reads ``dcp/.metadata`` with ``pickle``) asks
:func:`~pilotrun.checkpoint.pinned.require_known` right before it does: a view of a known folder
only. *Known* means the sha256 of the folder's ``manifest.json`` is recorded in the ledger (the save
and export rows write the digest of the bytes they wrote, never of a re-read), so pilotrun itself
wrote exactly these bytes. Small files a decision rests on (``export.json``'s factory) are read once
and checked against the manifest (:func:`verified_bytes`): the bytes parsed are the bytes hashed.

| what | known | unknown, ``--trust`` | unknown |
| --- | --- | --- | --- |
| every file against the manifest (size, sha256, plain file) | checked | checked | checked |
| ``.pt`` files | ``torch.load(weights_only=True)`` | ``weights_only=True`` | refused |
| ``dcp/.metadata`` (a pickle) | read by torch's DCP | refused | refused |
| the factory an ``export.json`` names | imported | only the one the user names | refused |
| ``trust_remote_code`` in an adapter's ``base.json`` | only as the user's spec (``remote_code``) | same | same |

A policy ``bound_to_spec`` (the archive and its ``rerun_control.py``) imports only the run's own factory, the one its
lock recorded (``factory``, None when the spec names none), known folder or not. Every policy refuses a folder that
is a link, and a ``step-N`` folder whose manifest records another step (a renamed checkpoint is not that step).

Source of the DCP row: torch/distributed/checkpoint/filesystem.py, ``FileSystemReader.read_metadata``
calls ``pickle.load`` (torch 2.x); no safe reader is attempted here, so unknown DCP folders are refused.
"""
from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..ledger.records import kept_manifests
from ..safefile import FileProblem, read_bytes
from .digest import Digest, entry_digest, hasher
from .io import MANIFEST, CheckpointError, folder_problems, load_manifest

if TYPE_CHECKING:
    from ..ledger.store import Ledger

DCP_METADATA = "dcp/.metadata"
SMALL_FILE_CAP = 16 << 20  # export.json, base.json: kilobytes


class Refusal(str, enum.Enum):
    """Why a folder was not loaded: callers branch on this, never on the message."""

    DAMAGED = "damaged"            # a file differs from the manifest (named file by file)
    UNKNOWN = "unknown"            # the manifest is not recorded in the ledger and --trust was not given
    PICKLE = "pickle"              # loading would unpickle a file of an unknown folder (DCP metadata)
    FACTORY = "factory"            # an unknown export names a factory the user did not name
    OTHER_CONFIG = "other-config"  # written for another config hash (resume)
    LINK = "link"                  # the folder is a symbolic link: what it points to was not written there
    MISNAMED = "misnamed"          # a step-N folder whose manifest records another step (renamed)
    REMOTE_CODE = "remote-code"    # an artifact asks for trust_remote_code the user's own spec did not


class LoadRefused(CheckpointError):
    """A folder the policy does not load; ``kind`` says why, ``problems`` lists each damaged file."""

    def __init__(self, kind: Refusal, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.problems = problems or []


def manifest_sha256(folder: Path) -> str:
    """The sha256 of ``folder``'s manifest as it is now. Never what a row records: a writer records the digest of
    the bytes it wrote (``AtomicFolder.manifest_sha256``), a reader that of the bytes it parsed (:class:`Admission`)."""
    return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()


def sha256_hex(raw: bytes) -> str:
    """A manifest's identity: the sha256 of its bytes (:mod:`.digest`, ``IDENTITY``)."""
    return hashlib.sha256(raw).hexdigest()


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


STEP_FOLDER = re.compile(r"step-(\d+)")

# Folders admitted in this process, by resolved path: what pinned() holds a view to.
_ADMITTED: dict[str, Admission] = {}


@dataclass(frozen=True)
class LoadPolicy:
    """``known``: manifest sha256s the ledger recorded; ``trust``: ``--trust`` (unknown may load, never
    unpickled); ``factory``: a factory the user named on the command line (``module:function``), or with
    ``bound_to_spec`` the run's own factory as its lock recorded it (None: the spec names none), the only one
    imported; ``remote_code``: the user's own spec sets ``model.trust_remote_code`` (an artifact never may)."""

    known: frozenset[str] = field(default_factory=frozenset)
    trust: bool = False
    factory: str | None = None
    bound_to_spec: bool = False
    remote_code: bool = False

    @classmethod
    def of(cls, known, trust: bool = False, factory: str | None = None, bound_to_spec: bool = False,
           remote_code: bool = False) -> LoadPolicy:
        return cls(frozenset(known or ()), trust, factory, bound_to_spec, remote_code)

    @classmethod
    def from_ledger(cls, ledger: Ledger, trust: bool = False, factory: str | None = None) -> LoadPolicy:
        return cls(frozenset(known_manifests(ledger)), trust, factory)

    def admit(self, folder: Path) -> Admission:
        """Check every file against the manifest, then the ledger; raise :class:`LoadRefused` or return the
        admission (registered for :func:`admitted`)."""
        folder = Path(folder)
        if folder.is_symlink():
            raise LoadRefused(Refusal.LINK, (
                f"{folder} is a symbolic link (to {os.readlink(folder)}): pilotrun loads only the folder it wrote, "
                "never one a link points to; copy the folder itself there"))
        try:
            manifest, raw = load_manifest(folder)  # read once: the digest is of the bytes parsed
        except CheckpointError as exc:
            raise LoadRefused(Refusal.DAMAGED, f"{folder} is damaged: {exc}", [str(exc)]) from None
        problems = folder_problems(folder, manifest)
        if problems:
            raise LoadRefused(Refusal.DAMAGED, f"{folder} is damaged: " + "; ".join(problems), problems)
        digest = sha256_hex(raw)
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
        _check_step_name(folder, manifest)
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
            info = json.loads(verified_bytes(adm, "export.json"))  # the bytes checked are the bytes parsed
            named = info["factory"]
        except (ValueError, KeyError, TypeError) as exc:
            raise LoadRefused(Refusal.DAMAGED, f"{meta}: field 'factory' is unreadable ({type(exc).__name__}: "
                                               f"{exc})") from None
        if not isinstance(named, str):
            raise LoadRefused(Refusal.DAMAGED, f"{meta}: field 'factory' is not a 'module:function' string")
        if self.bound_to_spec:
            if named == self.factory:
                return named
            raise LoadRefused(Refusal.FACTORY, (
                f"{meta} names the factory {named!r}, but the run's own spec (its lock) "
                + (f"names {self.factory!r}" if self.factory else "names no factory")
                + ": pilotrun imports only the spec's own factory, never one an artifact names"))
        if adm.known or (self.factory is not None and named == self.factory):
            return named
        who = f"you named {self.factory!r}" if self.factory else "no factory was named on the command line"
        raise LoadRefused(Refusal.FACTORY, (
            f"{meta} names the factory {named!r}, but this export's manifest (sha256 {adm.manifest_sha256[:12]}…) is "
            f"not recorded in the ledger and {who}: pilotrun imports nothing an unknown artifact names; load it with "
            "the ledger that recorded the export, or rebuild the model from your own spec's factory"))


    def admit_base(self, adm: Admission, factory: str | None, remote_code: bool) -> None:
        """The base an admitted adapter export's ``base.json`` spec builds: its factory is imported only as
        :meth:`export_factory` would import one, and ``trust_remote_code`` only when the user's own spec asks."""
        where = adm.folder / "base.json"
        if remote_code and not self.remote_code:
            raise LoadRefused(Refusal.REMOTE_CODE, (
                f"{where}: its spec sets model.trust_remote_code, but the spec of this job (its lock) does not: "
                "pilotrun never runs model code because an artifact asks; set it in your own spec to allow it"))
        if factory is None:
            return
        if self.bound_to_spec and factory != self.factory:
            raise LoadRefused(Refusal.FACTORY, (
                f"{where} builds its base with the factory {factory!r}, but the run's own spec (its lock) "
                + (f"names {self.factory!r}" if self.factory else "names no factory")
                + ": pilotrun imports only the spec's own factory"))
        if not adm.known and factory != self.factory:
            raise LoadRefused(Refusal.FACTORY, (
                f"{where} builds its base with the factory {factory!r}, but this export is not recorded in "
                "the ledger and that factory was not named: pilotrun imports nothing an unknown artifact names"))


def folder_step(folder: Path) -> int | None:
    """The step a ``step-N`` folder's name says it holds (None: another name, e.g. a campaign's ``final``)."""
    named = STEP_FOLDER.fullmatch(Path(folder).name)
    return int(named.group(1)) if named else None


def _check_step_name(folder: Path, manifest: dict) -> None:
    """A ``step-N`` folder holds step N: renamed, it would be resumed and reported as a step it never was."""
    named, step = folder_step(folder), manifest.get("step")
    if named is None or "step" not in manifest or step == named:
        return
    valid = isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 10**9
    fix = f"give it back its name (step-{step:06d})" if valid else "it is not a checkpoint pilotrun wrote"
    raise LoadRefused(Refusal.MISNAMED, (
        f"{folder}: its manifest records step {step!r}, not {named} as the folder's name says: a checkpoint renamed "
        f"after its save is not loaded; {fix}"))


def verified_bytes(adm: Admission, name: str, cap: int = SMALL_FILE_CAP) -> bytes:
    """The bytes of a small listed file (``export.json``, ``base.json``), read once and checked against ``adm``'s
    manifest: what the caller parses is what was hashed (a file swapped after the admission is refused, never
    used)."""
    info = adm.manifest["files"].get(name)
    path = adm.folder / name
    if info is None:
        raise LoadRefused(Refusal.DAMAGED, f"{path} is not listed in its manifest", [f"{path} is not listed"])
    try:
        data = read_bytes(path, cap)
    except FileProblem as exc:
        raise LoadRefused(Refusal.DAMAGED, f"{exc}: not the file that was saved", [str(exc)]) from None
    found = entry_digest(info)
    algo, want = found if found is not None else (Digest.SHA256, "")
    h = hasher(algo)
    h.update(data)
    if len(data) != info.get("bytes") or h.hexdigest() != want:
        msg = f"{path} is not the file its manifest lists (changed after it was checked): not used"
        raise LoadRefused(Refusal.DAMAGED, msg, [msg])
    return data


def admitted(folder: Path) -> Admission | None:
    """The admission of ``folder`` in this process (None: it was never admitted here)."""
    return _ADMITTED.get(str(Path(folder).resolve()))


def known_manifests(ledger: Ledger, run_id: str | None = None) -> set[str]:
    """sha256 of every checkpoint and export manifest the ledger recorded (a pilot's save and export rows, a
    campaign run's kept manifests)."""
    found = set()
    runs = [ledger.run(run_id)] if run_id else ledger.runs(limit=1_000_000)
    for run in runs:
        if run is None:
            continue
        try:
            found |= set(kept_manifests(json.loads(run.get("meta_json") or "{}")).values())
        except ValueError:
            pass  # a meta the ledger cannot parse records nothing
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
