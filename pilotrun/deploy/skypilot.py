"""A plan's choice as a SkyPilot task: the accelerators and their count, spot when the plan allows preemption, disk
from the checkpoint and export sizes, the lock's environment reproduced and verified, the pilot run first on the
real accelerator, then the campaign or the long run, each step safe to run again after a preemption.

:func:`task_text` is a function from :class:`TaskInputs` (plan data, gathered by the CLI) to the task's YAML, every
value with a comment saying where it came from; an unknown is written as a comment that says so, never guessed.
Nothing here asks a cloud, imports SkyPilot or writes a file.

Example::

    text = task_text(TaskInputs(name="llama-7b-sft", spec_rel="llama-7b-estimate/pilot.yaml", row=row, ...))
    Path("task.yaml").write_text(text)     # then: sky jobs launch task.yaml

The node's side of the contract (what ``run`` relies on): ``pilotrun run|launch SPEC --task-id`` runs the pilot once
per task (a restart skips a pilot that passed and continues one cut short), ``pilotrun campaign FILE --task-id``
starts the campaign once and continues it after a restart (every run kept once, a cut-short run continued as a new
linked run), and the ledger and run folders live on the bucket, so a restarted task finds them.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field

from ..config.paths import DATA_MOUNTS_VAR
from ..humanize import human_bytes, money
from .requirements import NOT_ONE_LINE, PYTHON, Requirements, one_line

# Where things are on the node. The bucket is mounted with SkyPilot's MOUNT_CACHED mode (rclone's full VFS cache):
# random writes (SQLite's) go to local disk and are uploaded behind, so a preemption loses only the last seconds.
BUCKET_MOUNT = "/pilotrun-bucket"
LOCK_MOUNT = "/pilotrun/proven-lock.json"
SOURCE_MOUNT = "/pilotrun/src"
DATA_MOUNT = "/pilotrun-data"  # bucket folders data.path names, copied there (config.paths.DATA_MOUNTS_VAR)
VENV = "$HOME/pilotrun-venv"
REQUIREMENTS = "$HOME/.pilotrun/requirements.lock.txt"
UV = "uv==0.13.9"  # only makes the venv of the lock's python (pip cannot pin python); any recent uv would do
# The node's own disk beyond what the job writes: the image's OS and the venv (a CUDA torch and its libraries are
# ~8 GB; images ship CUDA, drivers and conda). An assumption, said in the task.
BASE_DISK_GB = 60
RDZV_PORT = 29500
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
BUCKET_URI = re.compile(r"^(s3|gs|r2|cos|oci|https)://[A-Za-z0-9._~/:@+=%-]+$")
HEREDOC_END = "PILOTRUN_REQUIREMENTS"
# Characters a local path must not hold to be a workdir or a file mount: SkyPilot hands those paths to rsync quoted
# with Python's repr(), which a shell reads as double quotes when the path holds a ' ($(...) and `...` then run), and
# YAML and the scripts take the control characters as line breaks. The scripts quote every path themselves.
UNSAFE_PATH = re.compile(r"[$`'\"\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A path the run script may write inside "$WORKDIR/...": nothing a shell expands in double quotes.
PLAIN_PATH = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


class TaskRefused(ValueError):
    """The plan cannot be written as a task (a row that does not fit, a program's campaign over several nodes, a
    path SkyPilot would not upload as written): the message names the flag or the file and the fix."""


@dataclass(frozen=True)
class Bucket:
    value: str          # a bucket name SkyPilot creates and keeps, or the URI of an existing one
    source: str         # where the value came from

    @property
    def is_uri(self) -> bool:
        return bool(BUCKET_URI.match(self.value))


def path_problem(path: str) -> str | None:
    """Why a local path cannot be a workdir or a file mount, or None."""
    bad = sorted(set(UNSAFE_PATH.findall(path)))
    if not bad:
        return None
    return (f"holds {', '.join(one_line(repr(c)) for c in bad)}, which SkyPilot's upload (rsync, the path quoted with "
            "Python's repr) does not pass to a shell safely; rename it")


def bucket_problem(value: str) -> str | None:
    """Why ``--bucket`` is not a bucket SkyPilot can mount, or None."""
    if BUCKET_URI.match(value) or BUCKET_NAME.match(value):
        return None
    return (f"{one_line(repr(value))} is neither a bucket name (3-63 lowercase letters, digits, '.' or '-') nor a "
            "bucket URI (s3://, gs://, r2://, cos://, oci://, https://; letters, digits and ._~/:@+=%- after it)")


@dataclass(frozen=True)
class Mount:
    dst: str
    src: str
    why: str


@dataclass(frozen=True)
class PilotrunSource:
    """How the node gets pilotrun: a local source folder mounted and installed, or a pip requirement."""

    folder: str | None     # a source tree to mount at SOURCE_MOUNT
    requirement: str | None
    why: str


@dataclass(frozen=True)
class Size:
    bytes: int | None
    why: str


@dataclass
class CampaignPart:
    path_rel: str          # the campaign file, relative to the workdir
    runs: int              # declared runs (values x seeds)
    processes: int
    keep_checkpoint: bool
    keep_export: bool
    over_nodes: bool = True  # its runs may span several nodes (not a program's: it starts its own launcher)


@dataclass
class TaskInputs:
    name: str                          # the spec's name
    spec_rel: str                      # the spec, relative to the workdir
    workdir: str                       # the local folder SkyPilot syncs to ~/sky_workdir
    workdir_why: str
    row: dict                          # the selection sheet's row (it fits)
    per_run: dict | None               # the plan's pipeline for the row (estimate/plan.pipeline_hours)
    runs: int                          # runs of the pipeline the plan was asked for
    overrides: list[tuple[str, object, object]]  # (key, the spec's value, the plan's value)
    lock: dict
    lock_from: str
    lock_file: str                     # the lock.json the task mounts at LOCK_MOUNT
    requirements: Requirements
    bucket: Bucket
    spot: bool
    checkpoint: Size
    export: Size
    model_download: Size
    data: Size
    source: PilotrunSource
    mounts: list[Mount] = field(default_factory=list)      # data outside the workdir, at the path the spec names
    data_buckets: dict[str, str] = field(default_factory=dict)  # bucket folder data.path names -> its node path
    in_workdir: list[str] = field(default_factory=list)    # local files that travel with the workdir
    campaign: CampaignPart | None = None
    long_run: str | None = None
    keep_checkpoints: int = 2          # a long run's checkpoints kept at once (--keep-checkpoints)
    notes: list[str] = field(default_factory=list)


# -- a tiny YAML writer: keys in order, a comment above each value (YAML's own comments), block scalars ---------------

@dataclass
class Block:
    """A multi-line string written as a literal block (``|``): a shell script. Its only line break is \\n: any other
    (\\r, \\x85, \\u2028, a control character) YAML or the writer would take for one, so a value could end a
    comment line or a quoted word of the script; every value is quoted or :func:`one_line`-d before it gets here."""

    text: str

    def __post_init__(self) -> None:
        bad = NOT_ONE_LINE.search(self.text.replace("\n", ""))
        if bad:
            raise ValueError(f"a script holds {bad.group()!r}, which is not its line break: a value was not quoted")


Entry = tuple  # (key, value, comment): value a scalar, a Block, or a list of entries (a mapping)


def _scalar(value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z0-9_./:@+~-]+", text) and not re.fullmatch(r"[\d.]+|true|false|null|yes|no|"
                                                                                    r"on|off|~", text.lower()) \
        else json.dumps(text)


def _comment(text: str, pad: str) -> list[str]:
    # split on \n alone and one_line each: a value's other line breaks stay inside its comment line
    lines = text.removesuffix("\n").split("\n") if text else []
    return [f"{pad}# {one_line(line)}" if line else f"{pad}#" for line in lines]


def render(entries: list, indent: int = 0) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, value, comment in entries:
        lines += _comment(comment, pad)
        if value is None and isinstance(key, str) and key.startswith("#"):
            continue  # a comment alone (an unknown value, said but not written)
        if isinstance(value, list):
            lines.append(f"{pad}{_scalar(key)}:")
            lines += render(value, indent + 2)
        elif isinstance(value, Block):
            lines.append(f"{pad}{_scalar(key)}: |")
            lines += [f"{pad}  {line}" if line else "" for line in value.text.rstrip("\n").split("\n")]
        else:
            lines.append(f"{pad}{_scalar(key)}: {_scalar(value)}")
    return lines


# -- the values ------------------------------------------------------------------------------------------------------

def nodes(row: dict) -> tuple[int, int]:
    """(nodes, accelerators per node) for the row's GPUs: one node while they fit in one."""
    per_node = max(1, int(row.get("gpus_per_node") or 8))
    n = math.ceil(row["gpus"] / per_node)
    return n, row["gpus"] // n


def _config_line(row: dict) -> str:
    ac = " + activation checkpointing" if row["activation_checkpointing"] else ""
    return (f"{row['strategy']} x{row['gpus']}{ac}, micro batch {row['micro_batch_size']} x {row['grad_accum_steps']} "
            f"per rank, {row['precision']}")


def image_id(lock: dict) -> tuple[str | None, str]:
    """SkyPilot's ``image_id`` for the lock's container (``docker:IMAGE@sha256:...``), or None and why not."""
    c = lock.get("container") or {}
    digest = c.get("digest")
    if not digest:
        inside = " (it ran inside a container that did not expose its digest)" if c.get("inside_container") else ""
        return None, (f"image_id: unknown: the lock records no container digest{inside}; SkyPilot's default image, "
                      "and the setup below reproduces the lock's python and distributions")
    if "@" not in digest:
        return None, (f"image_id: unknown: the lock's container digest {digest} names no image (SkyPilot needs "
                      "IMAGE@sha256:...; record it with --container-digest IMAGE@sha256:...); SkyPilot's default image")
    return f"docker:{digest}", f"the lock's container digest ({c.get('from') or 'recorded'}) as SkyPilot's docker image"


def disk(inp: TaskInputs) -> tuple[int, str]:
    """(GB, how): the node's base, the model and data downloads, and every checkpoint and export kept at once."""
    ckpts, exports, counts = 2, 1, ["the pilot's save, the resume gate's checkpoint and the export"]
    if inp.campaign is not None:
        c = inp.campaign
        ckpts += c.runs if c.keep_checkpoint else 0
        exports += c.runs if c.keep_export else 0
        counts.append(f"the campaign's {c.runs} run(s): keep.checkpoint {str(c.keep_checkpoint).lower()}, "
                      f"keep.export {str(c.keep_export).lower()}")
    if inp.long_run is not None:
        ckpts += inp.keep_checkpoints
        exports += 1
        counts.append(f"the long run's {inp.keep_checkpoints} checkpoint(s) kept at once (--keep-checkpoints) and its "
                      "export")
    parts = [(f"base {BASE_DISK_GB} GB (the image and the venv: assumed)", BASE_DISK_GB * 1e9)]
    unknown = []
    for label, size, times in (("checkpoint", inp.checkpoint, ckpts), ("export", inp.export, exports),
                               ("model download", inp.model_download, 1), ("data", inp.data, 1)):
        if size.bytes is None:
            unknown.append(f"{label}: unknown ({size.why})")
            continue
        if size.bytes:
            parts.append((f"{times} x {label} {human_bytes(size.bytes)} ({size.why})", times * size.bytes))
    gb = math.ceil(sum(b for _, b in parts) / 1e9)
    how = (f"GB: {' + '.join(p for p, _ in parts)}; kept: {'; '.join(counts)}. The checkpoints go to the bucket; "
           "its MOUNT_CACHED cache holds them on this disk until uploaded")
    if unknown:
        how += "; not counted: " + "; ".join(unknown)
    return gb, how


def _cost_line(inp: TaskInputs) -> str:
    p = inp.per_run
    if p is None:
        return "cost: not planned (write the task with `pilotrun plan --skypilot` for the pipeline and its cost)"
    hours = p["hours"] * inp.runs
    unknown = f"; not estimated: {', '.join(str(u) for u in p['unknown'])}" if p["unknown"] else ""
    if p["cost"] is None:
        cost = f"cost unknown: {p.get('cost_note') or 'no price in the catalog'}"
    else:
        cost = f"cost {money(p['cost'] * inp.runs)} at {p['price_per_gpu_hour']:g} per GPU-hour"
    spot = ""
    if p.get("spot"):
        rec = next((i for i in p["items"] if str(i["item"]) == "spot recovery (expected)"), None)
        if rec is not None:
            spot = f" (spot: {rec['hours'] * inp.runs:.1f} h of it the expected recovery)"
    return f"the plan: {hours:.1f} h for {inp.runs} run(s) on {inp.row['gpus']} GPU(s){spot}; {cost}{unknown}"


def _setup(inp: TaskInputs) -> Block:
    req = inp.requirements
    py = req.python
    if py is not None and not PYTHON.match(py):  # requirements() refuses one; a TaskInputs made by hand must too
        raise TaskRefused(f"the lock's versions.python is {one_line(repr(py))}, not a python version (3.11.7)")
    lines = [f"# Reproduce the lock of {one_line(inp.lock_from)}; stop (exit 1) when the installed versions differ "
             "from it.",
             "set -euo pipefail"]
    if py:
        lines += [f"# python {py}: the lock's versions.python (pip cannot pin python; {UV} fetches it)",
                  f"python3 -m pip install --user --quiet {UV} || "
                  f"python3 -m pip install --user --quiet --break-system-packages {UV}",
                  'export PATH="$HOME/.local/bin:$PATH"',
                  f'uv venv --allow-existing --seed --python {shlex.quote(py)} "{VENV}"']
    else:
        lines += ["# python: unknown (the lock records no versions.python): the image's python3",
                  f'python3 -m venv "{VENV}"']
    body = req.text.rstrip("\n").split("\n")
    if HEREDOC_END in body:  # requirements() writes comments and pins only; a line that would end the file early
        raise TaskRefused(f"the requirements hold a line {HEREDOC_END}, which would end them early in the setup")
    lines += ["mkdir -p \"$HOME/.pilotrun\"",
              f"# every distribution at the lock's exact version (`pilotrun lock export`); {one_line(req.torch)}: "
              f"{one_line(req.torch_from)}",
              f"cat > \"{REQUIREMENTS}\" <<'{HEREDOC_END}'",
              *body,
              HEREDOC_END,
              f'"{VENV}/bin/python" -m pip install --quiet -r "{REQUIREMENTS}"']
    src = inp.source
    if src.folder:
        lines += [f"# pilotrun itself, from its source ({one_line(src.why)}; file_mounts {SOURCE_MOUNT}), without "
                  "dependencies: the lock pins them",
                  f'"{VENV}/bin/python" -m pip install --quiet --no-deps {SOURCE_MOUNT}']
    else:
        lines += [f"# pilotrun itself ({one_line(src.why)}), without dependencies: the lock pins them",
                  f'"{VENV}/bin/python" -m pip install --quiet --no-deps {shlex.quote(src.requirement or "pilotrun")}']
    lines += ["# the environment must be the lock's: each distribution that differs is named, and the setup stops",
              f'"{VENV}/bin/python" -m pilotrun lock check "{REQUIREMENTS}"']
    return Block("\n".join(lines) + "\n")


def _sets(inp: TaskInputs) -> str:
    return "".join(f" --set {shlex.quote(f'{k}={_set_value(v)}')}" for k, _, v in inp.overrides)


def _set_value(v) -> str:
    return json.dumps(v) if isinstance(v, bool) else str(v)


def in_workdir(rel: str) -> str:
    """A path relative to the workdir as one shell word: ``"$WORKDIR/rel"`` when nothing in it is special to a shell,
    else ``"$WORKDIR"/'rel'`` (a name such as ``toy$(touch x).yaml`` stays a name). TaskRefused for a control
    character or a line break other than \\n, which YAML would change on the way to the node."""
    if bad := NOT_ONE_LINE.search(rel.replace("\n", "")):
        raise TaskRefused(f"the file {one_line(repr(rel))} (in the workdir) has {one_line(repr(bad.group()))} in its "
                          "name, which the task's YAML would not keep as written: rename it")
    return f'"$WORKDIR/{rel}"' if PLAIN_PATH.match(rel) else '"$WORKDIR"/' + shlex.quote(rel)


# Several nodes: SkyPilot runs the same script on every node with these set (docs.skypilot.co, "Distributed
# Multi-Node Jobs"): the nodes' IPs one a line, the head node's first; this node's rank; the GPUs on each node.
NODE_SETUP = [
    "# Several nodes: SkyPilot runs this script on every node. Node 0 (the first of $SKYPILOT_NODE_IPS) hosts",
    "# torchrun's rendezvous; only node 0 writes the ledger and the run folders on the bucket. In the pilot another",
    "# node keeps its ranks' rows in a ledger on its own disk, started from a copy of the bucket's (read, never",
    "# written), so that --task-id decides on every node what node 0 decides: a preemption of any node relaunches",
    "# all of them, and the pilot is skipped, stopped again or run again on all of them together. In the campaign",
    "# node 0 decides alone and the other nodes follow it, handing their ranks' rows to node 0.",
    'NODE="${SKYPILOT_NODE_RANK:?is not set: SkyPilot sets it on every node}"',
    'NNODES="${SKYPILOT_NUM_NODES:?is not set: SkyPilot sets it on every node}"',
    'PER_NODE="${SKYPILOT_NUM_GPUS_PER_NODE:?is not set: SkyPilot sets it on every node}"',
    'HEAD="$(echo "${SKYPILOT_NODE_IPS:?is not set: SkyPilot sets it on every node}" | head -n1)"',
    f'RDZV="$HEAD:${{PILOTRUN_RDZV_PORT:-{RDZV_PORT}}}"',
    'if [ "$NODE" = 0 ]; then',
    '  mkdir -p "$PILOTRUN_BUCKET" && cd "$PILOTRUN_BUCKET"   # runs/ goes to the bucket',
    'else',
    '  NODE_DIR="${PILOTRUN_NODE_DIR:-$HOME/pilotrun-node}"',
    '  mkdir -p "$NODE_DIR" && cd "$NODE_DIR"',
    '  LEDGER="$NODE_DIR/ledger.sqlite"',
    '  rm -f "$LEDGER" "$LEDGER-wal" "$LEDGER-shm"',
    '  for f in "" -wal; do if [ -f "$PILOTRUN_LEDGER$f" ]; then cp "$PILOTRUN_LEDGER$f" "$LEDGER$f"; fi; done',
    '  export PILOTRUN_LEDGER="$LEDGER"',
    'fi',
]


def _pilot(inp: TaskInputs, spec: str, sets: str) -> list[str]:
    """The step that pilots the task's accelerators: one process, torchrun on this node, or torchrun on every node
    meeting at node 0's rendezvous."""
    row, (n, _) = inp.row, nodes(inp.row)
    tail = f'{spec}{sets} --task-id "$TASK" --proven-lock "$PILOTRUN_PROVEN_LOCK"'
    if n > 1:
        return ['"$PY" -m pilotrun launch --nnodes "$NNODES" --node-rank "$NODE" --rdzv-endpoint "$RDZV" '
                f'--nproc-per-node "$PER_NODE" {tail}']
    if row["gpus"] > 1:
        return [f'"$PY" -m pilotrun launch --nproc-per-node {row["gpus"]} {tail}']
    return [f'"$PY" -m pilotrun run {tail}']


def _run(inp: TaskInputs) -> Block:
    row = inp.row
    several = nodes(row)[0] > 1
    lines = ["# Every step is safe to run again: SkyPilot's managed-job recovery runs this script from the top on a",
             "# new node after a preemption. The ledger ($PILOTRUN_LEDGER) and the run folders (runs/) live on the",
             "# bucket, and --task-id (SkyPilot's $SKYPILOT_TASK_ID, the same across recoveries) lets each step find",
             "# what the task already did there.",
             "set -euo pipefail",
             'WORKDIR="$PWD"   # ~/sky_workdir: the workdir SkyPilot synced',
             f'PY="${{PILOTRUN_PYTHON:-{VENV}/bin/python}}"   # the venv the setup made',
             'TASK="${SKYPILOT_TASK_ID:?is not set: SkyPilot sets it, the same across recoveries}"']
    lines += NODE_SETUP if several else ['mkdir -p "$PILOTRUN_BUCKET" && cd "$PILOTRUN_BUCKET"   # runs/ goes to the '
                                         'bucket']
    spec = in_workdir(inp.spec_rel)
    sets = _sets(inp)
    changed = one_line(", ".join(f"{k} {_set_value(a)} -> {_set_value(b)}" for k, a, b in inp.overrides))
    lines += [f"# 1. the pilot on {'the whole cluster' if several else 'this node'}'s accelerators: the same spec" +
              (f", at the plan's configuration ({changed})" if changed else " as written") +
              f"; a failed gate ends the task (exit 1{' on every node' if several else ''}).",
              "#    A restart skips a pilot of this task that passed and continues one cut short. Its lock gate",
              "#    compares this node's environment with the proven lock and names what drifted."]
    if inp.data_buckets:
        lines.append(f"#    The data it proves: {one_line(', '.join(inp.data_buckets))}, copied onto the node "
                     f"(${DATA_MOUNTS_VAR} says where); its lock records the files' hashes and the listing.")
    lines += _pilot(inp, spec, sets)
    if inp.campaign is not None:
        c = inp.campaign
        how = ('--nnodes "$NNODES" --node-rank "$NODE" --rdzv-endpoint "$RDZV" --nproc-per-node "$PER_NODE"'
               "   # every run over the whole cluster, one at a time: node 0 runs the campaign and writes the ledger, "
               "the other nodes follow it" if several else
               f"--engine ray --parallel {max(1, row['gpus'] // c.processes)}   # processes: {c.processes} per run "
               "(the campaign file): each run a torchrun-style group in a Ray task on this node"
               if c.processes > 1 else
               f"--parallel {row['gpus']}   # one run per GPU (a program's run: one per process it launches)")
        lines += [f"# 2. the campaign ({c.runs} declared run(s)): started once; a restart continues it as --resume "
                  "does:",
                  "#    every run kept once, a run the preemption cut short continues as a new run linked to it; a",
                  "#    run that failed (its job raised, or ended without a result) ends the task (exit 1"
                  + (" on every node" if several else "") + ") after every",
                  "#    row is written, before any later step.",
                  f'"$PY" -m pilotrun campaign {in_workdir(c.path_rel)} --task-id "$TASK" {how}']
    if inp.long_run is not None:
        step = 3 if inp.campaign is not None else 2
        lines += [f"# {step}. the long run (--long-run), once the pilot passed: your command, run again from here on "
                  "a restart,",
                  "#    so it must continue from its own checkpoints under $PILOTRUN_BUCKET"
                  + (f" (the plan's configuration: {changed})" if changed else "")]
        if several:
            lines.append('#    It runs on every node: start your launcher with --nnodes "$NNODES" --node-rank "$NODE" '
                         '--rdzv-endpoint "$RDZV" --nproc-per-node "$PER_NODE" (set above), as the pilot did.')
        lines.append(inp.long_run)
    if inp.campaign is None and inp.long_run is None:
        lines.append("# no campaign (--campaign) or long run (--long-run) given: the task pilots the node and ends")
    return Block("\n".join(lines) + "\n")


def _check_paths(inp: TaskInputs) -> None:
    """TaskRefused naming the first local path (the workdir, a mount's source or destination) SkyPilot cannot upload
    safely (:func:`path_problem`)."""
    named = [(f"the workdir {inp.workdir} (the spec's folder)", inp.workdir),
             (f"the lock file {inp.lock_file}", inp.lock_file)]
    if inp.source.folder:
        named.append((f"pilotrun's source {inp.source.folder}", inp.source.folder))
    for m in inp.mounts:
        named += [(f"{m.why.split(':')[0]}: {m.src}", m.src), (f"{m.why.split(':')[0]}: its place on the node {m.dst}",
                                                                m.dst)]
    for what, path in named:
        if problem := path_problem(path):
            raise TaskRefused(f"{one_line(what)} {problem}")


def task_entries(inp: TaskInputs) -> list:
    row = inp.row
    _check_paths(inp)
    n, per_node = nodes(row)
    if n > 1 and inp.campaign is not None and not inp.campaign.over_nodes:
        raise TaskRefused(f"the plan runs {row['gpus']} GPUs of {row['accelerator']} over {n} nodes, and --campaign "
                          f"{inp.campaign.path_rel} runs your program, whose runs start its own launcher on one node: "
                          "a campaign over several nodes runs pilotrun's loop only; run the program's campaign as a "
                          "--long-run that starts its launcher on every node, or plan one node")
    sky_name = row.get("skypilot") or row["accelerator"]
    acc_why = (f"{row['accelerator']}'s SkyPilot name (the catalog's skypilot key) x the plan's {row['gpus']} GPU(s): "
               f"{_config_line(row)}" if row.get("skypilot") else
               f"unknown SkyPilot name: the catalog entry {row['accelerator']} has no skypilot key, so its catalog "
               f"name is written; check `sky show-gpus` and add skypilot: NAME to it (docs/catalog.md)")
    image, image_why = image_id(inp.lock)
    gb, gb_why = disk(inp)
    resources: list = [("accelerators", f"{sky_name}:{per_node}", acc_why)]
    if inp.spot:
        resources.append(("use_spot", True, "plan --spot: the plan allows preemption; its cost counts the expected "
                                            "recovery, and `sky jobs launch` relaunches the task after one"))
    else:
        resources.append(("use_spot", False, "on-demand: the plan was not asked for --spot"))
    resources.append(("disk_size", gb, gb_why))
    if image:
        resources.append(("image_id", image, image_why))
    else:
        resources.append(("#image_id", None, image_why))
    bucket = inp.bucket
    storage: list = ([("source", bucket.value, bucket.source)] if bucket.is_uri else
                     [("name", bucket.value, bucket.source), ("persistent", True, "kept after the job: the ledger and "
                                                                                   "checkpoints outlive the node")])
    storage.append(("mode", "MOUNT_CACHED", "written on local disk and uploaded behind it: SQLite and checkpoints "
                                            "need random writes, which plain MOUNT does not take"))
    mounts: list = [(BUCKET_MOUNT, storage, "the checkpoint and output bucket: the ledger, every run folder, "
                                            "checkpoints and exports; a restarted task finds them here")]
    mounts.append((LOCK_MOUNT, inp.lock_file, f"the proven lock ({inp.lock_from}) the node's pilot compares with"))
    if inp.source.folder:
        mounts.append((SOURCE_MOUNT, inp.source.folder, f"pilotrun's source ({inp.source.why}), installed by setup"))
    for m in inp.mounts:
        mounts.append((m.dst, m.src, m.why))
    workdir_comment = inp.workdir_why + ("\nwith it: " + "; ".join(inp.in_workdir) if inp.in_workdir else "")
    envs: list[Entry] = [
        ("PILOTRUN_BUCKET", BUCKET_MOUNT, "where the bucket is mounted (file_mounts)"),
        ("PILOTRUN_LEDGER", f"{BUCKET_MOUNT}/ledger.sqlite", "the ledger, on the bucket: every pilot, campaign and run "
                                                             "row of this task, kept across restarts"),
        ("PILOTRUN_PROVEN_LOCK", LOCK_MOUNT, "the lock the pilot's lock gate compares with (file_mounts)")]
    if inp.data_buckets:
        envs.append((DATA_MOUNTS_VAR, json.dumps(inp.data_buckets, sort_keys=True),
                     "where each bucket folder of data.path was copied (file_mounts): the pilot, the campaign and "
                     "their runs read the spec's bucket URIs there"))
    if n > 1:
        envs.append(("PILOTRUN_RDZV_PORT", RDZV_PORT, "the port of torchrun's rendezvous on node 0 (torchrun's "
                                                      "default; any port the nodes reach each other on); the "
                                                      "campaign's own store takes the next one"))
    header = (f"pilotrun plan --skypilot: {inp.name} on {row['accelerator']}, {_config_line(row)}.\n"
              f"{_cost_line(inp)}.\n"
              "Launch: sky jobs launch THIS_FILE (a managed job: relaunched after a preemption, its run resumes).\n"
              "Every value below says where it came from; an unknown is said, never guessed.")
    for note in inp.notes:
        header += f"\n{note}"
    return [
        ("#", None, header),
        ("name", f"pilotrun-{inp.name}", "the spec's name"),
        ("workdir", inp.workdir, workdir_comment),
        ("num_nodes", n, (f"{row['gpus']} GPU(s) fit one node" if n == 1 else f"the plan's {row['gpus']} GPUs as "
                          f"{n} nodes x {per_node}") + f" ({row.get('gpus_per_node')} per node: the catalog's "
                                                      "interconnect.gpus_per_node)"),
        ("resources", resources, ""),
        ("file_mounts", mounts, ""),
        ("envs", envs, ""),
        ("setup", _setup(inp), "python and every distribution at the lock's versions, verified"),
        ("run", _run(inp), "the pilot first, then " + ("the campaign" if inp.campaign else "") +
         (" and " if inp.campaign and inp.long_run else "") + ("the long run" if inp.long_run else "") +
         ("nothing else" if not inp.campaign and not inp.long_run else "")),
    ]


def task_text(inp: TaskInputs) -> str:
    """The task's YAML, every value with its source in a comment. Raises :class:`TaskRefused`."""
    return "\n".join(render(task_entries(inp))) + "\n"
