"""A checkpoint's state files checked against the job before a restore applies them.

Under ``--trust`` a checkpoint the ledger did not record may be loaded, so its JSON state files are input like any
other: :func:`~pilotrun.checkpoint.state.conform` checks their structure against the live objects; this checks
what structure cannot — that the numbers are in range and that the files belong to this checkpoint and this job.
``trainer_state.json``'s step is the one the manifest records (and the ``step-N`` folder's name says), every
count a whole number far below what breaks arithmetic, and ``config.json`` hashes to the manifest's config hash
and the job's own. A failure is a :class:`CheckpointError` naming the file and the field (the load gate's row).
"""
from __future__ import annotations

from pathlib import Path

from ..config.spec import canonical_sha256
from ..safefile import FileProblem, read_json
from .io import CheckpointError, read_manifest
from .trust import folder_step

# Far above any real run, far below what overflows the arithmetic done with them (a step of 1e30 is no run's).
MAX_STEP = 10**9
MAX_COUNT = 10**15
# A state file (fingerprints, trainer state, config) is kilobytes; a link to /dev/zero grew the restore worker to
# 21.5 GB.
STATE_JSON_CAP = 64 << 20


def _count_problem(value, top: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None  # the structure check (conform) names a value of the wrong type
    return None if 0 <= value < top else f"is {value}, outside 0 to {top:.0e}"


def check_trainer_state(path: Path, state: dict, manifest: dict) -> None:
    """``state`` (read from ``path``, already conformed to the live trainer's state) is in range and is the state of
    the step this checkpoint's manifest and folder name record."""
    found = state.get("data_position")
    pos: dict = found if isinstance(found, dict) else {}
    counts = {"step": (state.get("step"), MAX_STEP), "examples_seen": (state.get("examples_seen"), MAX_COUNT),
              **{f"data_position.{k}": (pos.get(k), MAX_COUNT) for k in ("epoch", "micro_index")}}
    for name, (value, top) in counts.items():
        why = _count_problem(value, top)
        if why is not None:
            raise CheckpointError(f"{path}: field {name} {why}: not a state pilotrun wrote; not loaded")
    step = state.get("step")
    recorded = manifest.get("step")
    named = folder_step(path.parent)
    if recorded is not None and step != recorded:
        raise CheckpointError(f"{path}: field step is {step}, but {path.parent}'s manifest records step {recorded}: "
                              "not the state saved with it; not loaded")
    if named is not None and step != named:
        raise CheckpointError(f"{path}: field step is {step}, but its folder is named {path.parent.name}: a renamed "
                              "checkpoint is not resumed as another step; not loaded")


def check_config(folder: Path, job_hash: str | None) -> None:
    """``config.json`` is the config the checkpoint was written for (its manifest's hash) and this job's."""
    folder = Path(folder)
    want = read_manifest(folder).get("config_hash")
    path = folder / "config.json"
    if not isinstance(want, str) or not path.is_file():
        return
    try:
        config = read_json(path, STATE_JSON_CAP)
    except FileProblem as exc:
        raise CheckpointError(f"{exc}: not the config the checkpoint was written for") from None
    got = canonical_sha256(config)
    if got != want:
        raise CheckpointError(f"{path} hashes to config {got[:12]}…, not the {want[:12]}… its checkpoint was written "
                              "for: the config was replaced after the save; not loaded")
    if job_hash is not None and got != job_hash:
        raise CheckpointError(f"{path} is the config {got[:12]}…, this job's is {job_hash[:12]}…: a checkpoint of "
                              "another config is never restored")


def job_hash(trainer) -> str | None:
    """The config hash of the job a driver was built for (None: a driver without a spec)."""
    spec = getattr(trainer, "spec", None)
    return spec.config_hash() if spec is not None and hasattr(spec, "config_hash") else None
