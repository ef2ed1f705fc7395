"""``--skypilot TASK.yaml`` for ``pilotrun plan`` and ``pilotrun select``: gather the plan's data (the chosen row,
the pipeline, the lock, the files the spec names) and write the task that ``deploy/skypilot.py`` makes of it."""
from __future__ import annotations

import importlib.metadata
import json
import os
import posixpath
import re
import shlex
from pathlib import Path

from .. import __file__ as _pilotrun_init
from .. import __version__
from ..campaign import kinds
from ..campaign.spec import load_campaign
from ..config.paths import bucket_folder, is_bucket_uri, looks_local
from ..deploy.requirements import NOT_ONE_LINE, NoTorchIndex, Target, Unpinnable, one_line, requirements
from ..deploy.skypilot import (
    BUCKET_MOUNT,
    DATA_MOUNT,
    Bucket,
    CampaignPart,
    Mount,
    PilotrunSource,
    Size,
    TaskInputs,
    TaskRefused,
    bucket_problem,
    nodes,
    task_text,
)
from ..estimate.plan import Assumptions, pipeline_hours
from ..estimate.source import model_download
from ..humanize import human_bytes
from ..safefile import write_atomic
from .common import UsageError, ledger_if_present
from .lock import proven_lock

SKYPILOT_HELP = """SkyPilot task (--skypilot TASK.yaml, with one --accelerator): the plan's accelerators and count,
spot with --spot, disk from the checkpoint and export sizes, the lock reproduced and verified in setup, and a run
that pilots first, then the campaign (--campaign) or your long run (--long-run), each step safe to run again after
a preemption. The ledger and run folders live on --bucket. TASK.lock.json is written beside it (the lock the node
compares with). The task's workdir is the spec's folder; a file the spec names outside it is a file mount (the
campaign file must be in it). Launch it with `sky jobs launch TASK.yaml`."""
# SkyPilot syncs the workdir to ~/sky_workdir: a relative path out of the spec's folder lands there under ~.
NODE_WORKDIR = "sky_workdir"


def add_skypilot_args(p, spot_flag: bool = True) -> None:
    """The task's flags; ``spot_flag`` False where the command has its own --spot (plan)."""
    g = p.add_argument_group("SkyPilot task")
    g.add_argument("--skypilot", type=Path, metavar="TASK_YAML",
                   help="write the chosen row as a SkyPilot task (needs one --accelerator)")
    g.add_argument("--bucket", help="the checkpoint and output bucket: a name (SkyPilot creates and keeps it) or an "
                                    "existing bucket's URI, s3://... gs://... (default: pilotrun-<spec name>)")
    g.add_argument("--campaign", type=Path, metavar="CAMPAIGN_YAML",
                   help="the campaign the task runs after the pilot (its base must be this spec)")
    g.add_argument("--long-run", metavar="COMMAND",
                   help="your own command the task runs after the pilot; it must continue from its own checkpoints "
                        f"under $PILOTRUN_BUCKET ({BUCKET_MOUNT}) when the task restarts")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="with --long-run: the checkpoints your program keeps at once, for the disk (default 2)")
    g.add_argument("--lock", metavar="RUN_OR_LOCK_JSON",
                   help="the lock to reproduce: a run id or a lock.json (default: the newest passed pilot of this "
                        "config in the ledger, else this machine's environment, said so)")
    g.add_argument("--torch-index", metavar="URL",
                   help="the index the node's torch comes from (default: from the lock and the accelerator's stack)")
    if spot_flag:
        g.add_argument("--spot", action="store_true", help="preemptible capacity: use_spot, and the expected "
                                                           "recovery in the plan's cost")


def check_args(args) -> None:
    """Flags that go with --skypilot only, and one accelerator: exit 2 naming the flag before anything is traced."""
    if args.skypilot is None:
        given = [f for f, v in (("--bucket", args.bucket), ("--campaign", args.campaign), ("--long-run", args.long_run),
                                ("--lock", args.lock), ("--torch-index", args.torch_index)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} go(es) with --skypilot TASK.yaml")
        return
    if len(args.accelerator) != 1:
        raise UsageError("--skypilot writes one task: choose its accelerator with one --accelerator NAME "
                         "(`pilotrun select` lists them)")
    if args.bucket is not None and (problem := bucket_problem(args.bucket)):
        raise UsageError(f"--bucket: {problem}")
    if args.campaign is not None and not args.campaign.is_file():
        raise UsageError(f"--campaign: {args.campaign} is not a file; give the campaign YAML the task runs")
    if args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}")
    if args.long_run is not None and not args.long_run.strip():
        raise UsageError("--long-run is empty: give the command the task runs after the pilot")
    if args.long_run is not None and (bad := NOT_ONE_LINE.search(args.long_run.replace("\n", ""))):
        raise UsageError(f"--long-run holds {one_line(repr(bad.group()))}, a control character or a line break other "
                         "than \\n, which the task's YAML or the shell would read as another line: remove it")


def _overrides(spec, row: dict) -> list[tuple[str, object, object]]:
    """The spec keys the plan's row changes (the fixes it applied), as --set would."""
    t = spec.train
    pairs = [("distributed.strategy", spec.distributed.strategy, row["strategy"]),
             ("train.activation_checkpointing", t.activation_checkpointing, row["activation_checkpointing"]),
             ("train.micro_batch_size", t.micro_batch_size, row["micro_batch_size"]),
             ("train.grad_accum_steps", t.grad_accum_steps, row["grad_accum_steps"])]
    return [(k, a, b) for k, a, b in pairs if a != b]


def _local_files(spec) -> list[tuple[str, str, Path]]:
    """(spec key, as written, resolved) for every local file the spec names that the node needs."""
    out = []
    m = spec.model
    if m is not None:
        for key, value in (("model.hf", m.hf), ("model.tokenizer", m.tokenizer)):
            if isinstance(value, str) and looks_local(value) and not value.startswith("pkg:"):
                out.append((key, value, spec.resolve(value)))
    for key, value in _data_paths(spec).items():
        if isinstance(value, str) and not value.startswith("pkg:") and not is_bucket_uri(value):
            out.append((key, value, spec.resolve(value)))
    return out


def _data_paths(spec) -> dict[str, object]:
    """data.path by spec key: ``data.path`` for one file, ``data.path.<split>`` for each split."""
    d = spec.data
    if d is None:
        return {}
    return {"data.path": d.path} if isinstance(d.path, str) else {f"data.path.{k}": v for k, v in
                                                                 (d.path or {}).items()}


def _bucket_data(spec) -> tuple[dict[str, str], list[Mount]]:
    """Each bucket folder data.path names, copied onto the node (a file mount of the folder, SkyPilot's COPY: local
    disk speed for training) at DATA_MOUNT/<n>; a folder inside another one named is not copied twice. (folder ->
    node path, for $PILOTRUN_DATA_MOUNTS; the mounts)."""
    named = {key: value for key, value in _data_paths(spec).items() if isinstance(value, str) and is_bucket_uri(value)}
    wanted = sorted({bucket_folder(v) for v in named.values()})
    outer = [f for f in wanted if not any(f != o and f.startswith(o + "/") for o in wanted)]
    folders = {f: f"{DATA_MOUNT}/{i}" for i, f in enumerate(outer)}
    mounts = []
    for folder, node in folders.items():
        keys = [f"{k}: {v}" for k, v in named.items() if v.startswith(folder + "/")]
        mounts.append(Mount(node, folder, f"{'; '.join(keys)}, in a bucket: its folder is copied onto the node, and "
                                          "the pilot there proves this data (the lock records its files' hashes and "
                                          "the folder's listing)"))
    return folders, mounts


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _workdir(spec) -> tuple[Path, str, list[Mount], list[str], int]:
    """The workdir (the spec's folder, never a parent: SkyPilot uploads all of it), a file mount for each file the
    spec names outside it (by absolute path: the same path on the node; by relative path: where that path reaches
    from ~/sky_workdir), the notes of what travels with the workdir, and the local data's bytes. TaskRefused naming
    a relative path that climbs above the node's home folder, or a spec in the home folder itself."""
    root, mounts, notes, data_bytes = spec.folder, [], [], 0
    home = Path.home().resolve()
    if root == home or root in home.parents:
        raise TaskRefused(f"the spec {spec.source} is in {root}, your home folder or above it: the task's workdir is "
                          "the spec's folder, and SkyPilot would upload all of it (.ssh included); move the spec and "
                          "its files into a project folder")
    for key, written, path in _local_files(spec):
        if key.startswith("data.") and path.exists():
            data_bytes += _size(path.resolve())
        if Path(written).expanduser().is_absolute():
            mounts.append(Mount(str(path.resolve()), str(path.resolve()), f"{key}: {written} (as written in the spec: "
                                                                          "the same path on the node)"))
            continue
        node = posixpath.normpath(posixpath.join(NODE_WORKDIR, written))
        if node == NODE_WORKDIR or node.startswith(NODE_WORKDIR + "/"):
            notes.append(f"{key} {written}")
        elif node.startswith("..") or "~" in node:  # SkyPilot reads every ~ of a destination as the home folder
            raise TaskRefused(f"{key}: {written} is outside the spec's folder {root}, and "
                              + ("above the node's home folder once the spec is in ~/sky_workdir there" if "~" not in
                                 node else "its path holds a ~, which SkyPilot reads as the node's home folder")
                              + f": move it into {root} or a folder beside it, or name it by absolute path (mounted "
                              "at the same path on the node)")
        else:
            mounts.append(Mount(f"~/{node}", str(path.resolve()), f"{key}: {written}, outside the spec's folder: only "
                                                                  f"it is uploaded, to where the path reaches on the "
                                                                  f"node from ~/{NODE_WORKDIR}"))
    why = ("the spec's folder, uploaded whole (~/sky_workdir on the node; .gitignore and .skyignore apply), so its "
           "relative paths hold there; a file the spec names outside it is a file mount, never a reason to upload a "
           "parent folder")
    return root, why, mounts, notes, data_bytes


def pilotrun_source() -> PilotrunSource:
    """How the node gets the pilotrun that runs here: its source tree (mounted), or a pip requirement."""
    root = Path(_pilotrun_init).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"pilotrun"', pyproject.read_text()):
        return PilotrunSource(str(root), None, f"pilotrun {__version__} from the source tree {root}")
    try:
        direct = json.loads(importlib.metadata.distribution("pilotrun").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        direct = {}
    vcs = direct.get("vcs_info") or {}
    if vcs.get("commit_id"):
        req = f"pilotrun @ git+{direct['url']}@{vcs['commit_id']}"
        return PilotrunSource(None, req, f"pilotrun {__version__} from {direct['url']} at {vcs['commit_id'][:10]}")
    return PilotrunSource(None, f"pilotrun=={__version__}", f"pilotrun {__version__} from the package index (this "
                                                            "machine has it installed, not from a source tree)")


def _campaign(args, spec, row: dict, overrides) -> CampaignPart | None:
    if args.campaign is None:
        return None
    c = load_campaign(args.campaign)  # a SpecError names the campaign file's field
    base = (c.folder / c.base).resolve()
    if base != Path(spec.source).resolve():
        raise TaskRefused(f"--campaign {args.campaign}: its base is {base}, not the planned spec {spec.source}; plan "
                          "the campaign's base, so the task pilots what the campaign runs")
    if row["gpus"] > 1 and c.ranks != row["gpus"] and not overrides:  # a planned campaign gets the plan's count
        raise TaskRefused(f"--campaign {args.campaign}: the plan runs each run on {row['gpus']} GPUs "
                          f"({row['strategy']} x{row['gpus']}): set gpus_per_run: {row['gpus']} in the campaign file")
    rel = os.path.relpath(Path(args.campaign).resolve(), start=spec.folder)
    if rel.startswith(".."):
        raise TaskRefused(f"--campaign {args.campaign} is outside the spec's folder {spec.folder}, the task's workdir "
                          "(what SkyPilot uploads; its base must reach the spec there): move the campaign file into "
                          f"{spec.folder} and set its base to {Path(spec.source).name}")
    return CampaignPart(rel, len(c.values) * len(c.seeds), c.ranks, c.keep.checkpoint, c.keep.export,
                        over_nodes=kinds.of(c).over_nodes)


PLANNED = ".planned"  # the suffix of the spec and campaign files a plan that changes the spec writes


def planned_files(spec, campaign_file: Path, overrides, gpus: int) -> list[tuple[Path, str]]:
    """A plan that changes the spec, with a campaign: the spec with the plan's keys set (beside the spec: its relative
    paths hold) and the campaign with that spec as its base (beside the campaign), as (path, text), each text headed
    by what changed and the source's sha256; the task pilots and runs these, so no key is copied by hand."""
    import hashlib

    import yaml

    from ..config.load import apply_overrides, read_raw

    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    src, camp = Path(spec.source), Path(campaign_file)
    raw, _ = read_raw(src)
    apply_overrides(raw, [f"{k}={_value(b)}" for k, _, b in overrides])
    new_spec = src.with_name(src.stem + PLANNED + src.suffix)
    changed = ", ".join(f"{k}: {_value(a)} -> {_value(b)}" for k, a, b in overrides)
    spec_text = (f"# Written by pilotrun plan --skypilot: {src.name} (sha256 {sha(src)}) at the plan's configuration "
                 f"({changed}).\n# Edit {src.name} and plan again rather than this file.\n"
                 + yaml.safe_dump(raw, sort_keys=False))
    c_raw, _ = read_raw(camp)
    c_raw["base"] = os.path.relpath(new_spec, start=camp.parent)
    if gpus > 1:  # each run on the plan's GPUs, as the pilot
        c_raw.pop("processes", None)
        c_raw["gpus_per_run"] = gpus
    new_camp = camp.with_name(camp.stem + PLANNED + camp.suffix)
    camp_text = (f"# Written by pilotrun plan --skypilot: {camp.name} (sha256 {sha(camp)}) with its base at the plan's "
                 f"configuration, {new_spec.name} (sha256 {hashlib.sha256(spec_text.encode()).hexdigest()}).\n"
                 + yaml.safe_dump(c_raw, sort_keys=False))
    return [(new_spec, spec_text), (new_camp, camp_text)]


def _value(v) -> str:
    return json.dumps(v) if isinstance(v, bool) else str(v)


def write_task(spec, args, row: dict, traces, per_run: dict | None = None, runs: int = 1,
               assumptions: Assumptions | None = None) -> str:
    """Write ``args.skypilot`` (and the lock beside it) for ``row``; what was written, in words. UsageError (exit 2)
    naming what to change."""
    if not row["fits"]:
        raise UsageError(f"{row['accelerator']}: the job does not fit with any configuration tried "
                         f"({'; '.join(row['steps'])}): no task written")
    a = assumptions or Assumptions()
    if per_run is None:
        trace = traces.get(ac=row["activation_checkpointing"])
        per_run = pipeline_hours(spec, row, trace, ledger_if_present(args.ledger), a, model_download(spec),
                                 spot=args.spot)
    overrides = _overrides(spec, row)
    try:
        campaign = _campaign(args, spec, row, overrides)
        planned = (planned_files(spec, args.campaign, overrides, row["gpus"]) if campaign is not None and overrides
                   else [])
        spec_rel, notes_head = Path(spec.source).name, []
        if planned and campaign is not None:  # the task pilots and runs the written files, not the spec with --set
            spec_rel = planned[0][0].name
            campaign.path_rel = str(Path(campaign.path_rel).with_name(planned[1][0].name))
            campaign.processes = max(campaign.processes, row["gpus"])
            notes_head = [f"The plan changes the spec ({', '.join(f'{k}: {_value(b)}' for k, _, b in overrides)}): "
                          f"written as {planned[0][0].name} beside the spec and {planned[1][0].name} beside the "
                          "campaign (each headed by its source's sha256), which the task pilots and runs."]
            overrides = []
        lock, lock_from = proven_lock(spec, args.ledger, args.lock)
        try:
            req = requirements(lock, Target(row["stack"]), lock_from, args.torch_index)
        except (NoTorchIndex, Unpinnable) as exc:
            raise UsageError(f"{exc} (the lock of {one_line(lock_from)})") from None
        root, why, mounts, notes, data_bytes = _workdir(spec)
        data_buckets, bucket_mounts = _bucket_data(spec)
        sizes = per_run["sizes"]
        download = sizes["data_download"]
        data_why = [f"the spec's local data files, {human_bytes(data_bytes)}"] if data_bytes else []
        data_why += [download["from"]] if download["bytes"] else []
        data = Size(data_bytes + (download["bytes"] or 0), " + ".join(data_why) or "no data files to hold")
        if data_buckets:  # the known part counted, the copy said as unknown, never a guess
            unknown = (f"the data copied from {', '.join(data_buckets)}, whose size is not known here: add it to "
                       "disk_size")
            data = (Size(data.bytes, f"{data.why}; not counted: {unknown}") if data.bytes else
                    Size(None, unknown))
        task_file = Path(args.skypilot)
        lock_file = task_file.with_name(task_file.stem + ".lock.json")
        bucket = Bucket(args.bucket, "--bucket") if args.bucket else Bucket(
            _bucket_name(spec.name), "no --bucket: SkyPilot creates a bucket of this name (pilotrun-<spec name>); "
            "pass --bucket to name yours")
        inputs = TaskInputs(
            name=spec.name, spec_rel=spec_rel, workdir=str(root), notes=notes_head,
            workdir_why=why, row=row, per_run=per_run, runs=runs, overrides=overrides, lock=lock, lock_from=lock_from,
            lock_file=str(lock_file.resolve()), requirements=req, bucket=bucket, spot=args.spot,
            checkpoint=Size(sizes["per_checkpoint"]["bytes"], sizes["per_checkpoint"]["from"]),
            export=Size(sizes["per_export"]["bytes"], sizes["per_export"]["from"]),
            model_download=Size(sizes["model_download"]["bytes"], sizes["model_download"]["from"]), data=data,
            source=pilotrun_source(), mounts=mounts + bucket_mounts, data_buckets=data_buckets, in_workdir=notes,
            campaign=campaign, long_run=args.long_run,
            keep_checkpoints=args.keep_checkpoints)
        text = task_text(inputs)
    except TaskRefused as exc:
        raise UsageError(str(exc)) from None
    if not task_file.parent.is_dir():
        raise UsageError(f"--skypilot {task_file}: no folder {task_file.parent}; create it or write the task elsewhere")
    write_atomic(lock_file, json.dumps(lock, indent=1, sort_keys=True))  # WriteFailed names the path: exit 2
    for path, body in planned:
        write_atomic(path, body)
    write_atomic(task_file, text)
    n, per_node = nodes(row)
    where = f"{row['skypilot'] or row['accelerator']}:{per_node}" + (f" on each of {n} nodes" if n > 1 else "")
    return (f"wrote {task_file} ({where}, the lock of {lock_from}) and "
            f"{lock_file}" + "".join(f", {path}" for path, _ in planned)
            + f"; launch it with `sky jobs launch {shlex.quote(str(task_file))}`")


def _bucket_name(name: str) -> str:
    out = re.sub(r"[^a-z0-9.-]+", "-", f"pilotrun-{name}".lower()).strip("-.")[:63]
    return out if len(out) >= 3 else "pilotrun-runs"
