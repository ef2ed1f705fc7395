"""``pilotrun archive RUN_OR_CAMPAIGN``: one .tar.gz that outlives the rented machine.

Inside ``RUN_ID/``: ``model/`` (the safetensors export, hash-verified against its manifest
before packing), ``config/`` (the spec as written, the spec as run, the campaign file),
``lock.json``, ``metrics.csv`` / ``gates.csv`` / ``notes.csv`` (raw, from the ledger),
``run.json``, ``control/`` (the fixed control inputs and the outputs recorded for them),
``code/`` (a factory model's module), ``rerun_control.py`` (reloads the model with torch,
safetensors and transformers only — no pilotrun, no pickle — and checks the outputs) and a
README saying how. A run with no model (diverged, failed, export gate not passed) is still
archived, and its README says why there is no model. A campaign's archive holds every run
that way under ``runs/``, with the campaign file, the conclusion, the raw rows of all runs
and the HTML report.

Example::

    with Ledger("runs/ledger.sqlite") as led:
        path = archive_run(led, "lr-sweep-2026-r01", Path("lr-sweep-r01.tar.gz"))
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from ..campaign.conclude import link_text, stop_text
from ..checkpoint.io import MANIFEST, CheckpointError
from ..checkpoint.trust import LoadPolicy
from ..ledger.details import ExportDetails
from ..ledger.records import GateName, Kept, RunKind, Verdict, final_val_loss, kept_manifests
from ..ledger.store import Ledger
from ..ledger.tables import table, write_csv
from ..lock import sha256_file
from .archive_files import (
    LeftOut,
    UnsafeFile,
    copy_factory_code,
    copy_or_name,
    copy_plain,
    locked_factory,
    pack_manifest_files,
)

# Copied as is into the archive: it must run with torch, safetensors and transformers alone.
RERUN_SCRIPT = Path(__file__).with_name("rerun_control.py")


class ArchiveError(Exception):
    """The run cannot be archived as asked: the message names the run or file and the fix."""


def _copy_run_file(src: Path, dest: Path, run_folder: Path) -> None:
    try:
        copy_plain(src, dest, run_folder)
    except UnsafeFile as exc:
        raise ArchiveError(f"{exc}; remove it or archive without it") from None


def _recorded_export(led: Ledger, run: dict, meta: dict) -> str | None:
    """The export manifest's sha256 the ledger recorded for the run: a pilot's passing export row, a campaign run's
    kept manifests (None: nothing recorded, so the export on disk is not known)."""
    if run["kind"] == RunKind.CAMPAIGN_RUN:
        return kept_manifests(meta).get(Kept.EXPORT)
    rows = [g for g in led.gate_records(run["run_id"]) if g.gate == GateName.EXPORT and g.verdict == Verdict.PASS]
    sha = ExportDetails.of(rows[-1].details).manifest_sha256 if rows else None
    return sha if isinstance(sha, str) else None


def _control_files(run: dict, folder: Path) -> tuple[Path, Path] | None:
    pairs = [(folder / "control-inputs.safetensors", folder / "control-outputs.safetensors"),  # campaign run
             (folder / "workers" / "reload-inputs.safetensors",  # pilot
              folder / "workers" / "reload-outputs.safetensors")]
    return next(((i, o) for i, o in pairs if i.is_file() and o.is_file()), None)


def _why_no_model(run: dict, meta: dict, led: Ledger) -> str:
    if meta.get("stop_reason"):
        return f"the run {run['status']} at update {meta.get('stopped_at')}: {meta['stop_reason']}"
    export = [g for g in led.gate_records(run["run_id"]) if g.gate == GateName.EXPORT]
    if export and export[-1].verdict != Verdict.PASS:
        return f"the export gate did not pass ({export[-1].verdict}: {export[-1].reason})"
    if run["kind"] == "campaign-run":
        return "the campaign kept no export (keep.export: false)"
    return "no export was written (the export gate did not run)"


def _readme(run: dict, meta: dict, lock: dict, has_model: str | None, no_model: str | None, factory: str | None,
            files: dict[str, str], control_n: str | None) -> str:
    lines = [f"# {run['run_id']}", "", f"- name: {run['name']} · kind: {run['kind']} · status: **{run['status']}**",
             f"- started {run['started_at']} · ended {run['ended_at'] or '(no end recorded)'}"]
    if "variant" in meta:
        lines.append(f"- campaign {meta.get('campaign_id')}: {meta.get('key')} = {json.dumps(meta['variant'])}, "
                     f"seed {meta.get('seed')}{' (control)' if meta.get('control') else ''}"
                     + (f", retry of {meta['retry_of']} with {json.dumps(meta.get('changes'))}" if meta.get("retry_of")
                        else f", {link_text(meta)}" if meta.get("continues") else ""))
    if meta.get("stop_reason"):
        lines.append(f"- stopped at update {meta.get('stopped_at')}: {meta['stop_reason']}")
    final = final_val_loss(run["status"], meta)
    if final is not None:
        lines.append(f"- final validation loss {final:.6g} at update {meta['final'].get('step')}")
    versions = {k: v for k, v in (lock.get("versions") or {}).items() if v is not None}
    dists = lock.get("distributions") or {}
    versions.update({k: dists[k] for k in ("transformers", "safetensors", "tokenizers", "accelerate") if k in dists})
    if versions:
        lines.append("- lock: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    lines += ["", "## Reload the model", ""]
    if no_model:
        lines += [f"There is no model in this archive: {no_model}.", ""]
    elif has_model == ADAPTER:
        lines += _adapter_lines(files)
    elif factory:
        lines += [f"`model/` holds `model.safetensors` for the factory `{factory}` (its module is in `code/`) and "
                  "`export.json` with the mapping it is called with:", "", "```python",
                  "import json, sys; sys.path.insert(0, 'code')", "from safetensors.torch import load_model",
                  f"from {factory.split(':')[0]} import {factory.split(':')[1].split('.')[0]} as factory",
                  "info = json.load(open('model/export.json'))", "model = factory(info['model'])",
                  "load_model(model, 'model/model.safetensors')", "```", ""]
    else:
        lines += [f"`model/` is a Hugging Face folder (`{has_model}`, safetensors):", "", "```python",
                  "import transformers",
                  f"model = transformers.{has_model}.from_pretrained('model')"]
        if (files.get("model/tokenizer.json") or files.get("model/tokenizer_config.json")):
            lines.append("tokenizer = transformers.AutoTokenizer.from_pretrained('model')")
        lines += ["```", ""]
    if control_n and not no_model:
        lines += ["## Rerun the control inputs", "",
                  f"`control/inputs.safetensors` holds the fixed control inputs ({control_n}), "
                  "`control/outputs.safetensors` the outputs recorded when the run ended. This reloads the model in a "
                  "fresh process and compares:", "",
                  "```", "python rerun_control.py      # exit 0: the outputs match (rtol 1e-4, atol 1e-5)", "```", ""]
    spec_name = Path(run["spec_path"] or "pilot.yaml").name
    if "variant" in meta:
        rerun = ["`config/spec.json` is this run's spec as run (`written`: the campaign's base with the varied key, "
                 f"the seed and the update budget set); `config/{spec_name}` is the base as it is on disk when "
                 "archived and `config/campaign.json` the campaign as declared. The data files are not in this "
                 "archive; with them in place and the versions in `lock.json`, the original campaign file (its "
                 "`base` path is relative to it) reruns this run among the others:", "", "```",
                 "pilotrun campaign CAMPAIGN.yaml", "```", ""]
    else:
        rerun = ["`config/` holds the spec as written and as run (`spec.json`: overrides applied). The data files it "
                 "names are not in this archive; with them in place and the versions in `lock.json`:", "", "```",
                 f"pilotrun run config/{spec_name}    # the pilot gates on the same spec", "```", ""]
    lines += ["## Rerun the training", "", *rerun,
              "`metrics.csv` holds every per-update number the ledger recorded (loss, lr, grad norm, throughput, "
              "validation points); `gates.csv` the gate rows with their reasons; `notes.csv` the decisions noted.", "",
              "## Files", "", "| file | sha256 |", "|---|---|"]
    lines += [f"| {k} | `{v[:16]}…` |" for k, v in sorted(files.items())]
    return "\n".join(lines) + "\n"


ADAPTER = "adapter"  # model_class of an archive whose model/ is a PEFT adapter


def _adapter_lines(files: dict) -> list[str]:
    """How to load an archived adapter on its base (``model/base.json`` names the base and its identity)."""
    lines = ["`model/` is a PEFT LoRA adapter (`adapter_model.safetensors`, `adapter_config.json`), not a whole "
             "model: the frozen base is not in this archive. `model/base.json` says which base it was trained on "
             "(`how_to_load`, the spec that builds it, its sha256 `base_identity`). Load the base the way "
             "`how_to_load` says, then the adapter on it:", "", "```python", "import json, peft",
             "base_info = json.load(open('model/base.json'))",
             "print(base_info['how_to_load'])",
             "base = ...  # the base model, built or loaded as base_info says",
             "model = peft.PeftModel.from_pretrained(base, 'model')", "```", "",
             "pilotrun rebuilds the base from that spec and checks its identity before loading the adapter:", "",
             "```python", "import json", "from pathlib import Path",
             "from pilotrun.checkpoint.trust import LoadPolicy",
             "from pilotrun.workers.reload import load_artifact",
             "rec = json.load(open('run.json'))['recorded']  # what the ledger recorded: this manifest, this factory",
             "model = load_artifact(Path('model'), LoadPolicy.of([rec['model_manifest_sha256']], "
             "factory=rec['factory'], bound_to_spec=True, remote_code=rec['trust_remote_code']))", "```", ""]
    if any(k.startswith("model/merged/") for k in files):
        lines += ["`model/merged/` is the base with the adapter merged in, a plain Hugging Face folder "
                  "(`transformers.AutoModelForCausalLM.from_pretrained('model/merged')`).", ""]
    return lines


def _pack_model(led: Ledger, run: dict, meta: dict, lock: dict, root: Path, left_out: list[LeftOut]) -> dict:
    """Copy the run's export into ``root / "model"`` — only if the ledger recorded its manifest, admitted by the one
    loading policy bound to the run's own spec — and the factory's module into ``code/``. Returns what the README
    and ``rerun_control.py`` read: the model's class or factory, and what was recorded."""
    folder = Path(run["out_dir"])
    model_dir = folder / "export"
    recorded = _recorded_export(led, run, meta)
    if recorded is None:
        raise ArchiveError(
            f"{model_dir / MANIFEST}: this export's manifest is not recorded in the ledger (no passing export row, no "
            "manifest in the campaign run's row), so pilotrun cannot tell it from one rewritten after the run: not "
            "archived; archive with the ledger that recorded it (--ledger), or rerun the run")
    own = locked_factory(lock)
    if not isinstance(lock.get("model"), dict) and (model_dir / "export.json").is_file():
        raise ArchiveError(
            f"{model_dir / 'export.json'} names a factory, but run {run['run_id']} recorded no lock (its lock gate did "
            "not run), so nothing says which factory is the spec's own: not archived; run the pilot with the lock "
            "gate (--gates lock,...) to archive a factory model")
    remote = bool(((lock.get("config") or {}).get("model") or {}).get("trust_remote_code"))
    try:
        left = pack_manifest_files(model_dir, root / "model", folder, recorded)["left_out"]
        policy = LoadPolicy.of({recorded}, factory=own, bound_to_spec=True, remote_code=remote)
        adm = policy.admit(root / "model")  # the copy: exactly the listed files, each checked
        factory = policy.export_factory(adm)
    except CheckpointError as exc:
        raise ArchiveError(f"the model of {run['run_id']} is not archived: {exc}") from None
    left_out += [LeftOut(str(model_dir / name), "not in the model's manifest") for name in left]
    out = {"left": left, "factory": factory, "model_class": None,
           "recorded": {"model_manifest_sha256": recorded, "factory": own, "trust_remote_code": remote}}
    if factory is not None:
        copy_factory_code(lock, run["spec_path"], root / "code", left_out)
    elif (root / "model" / "base.json").is_file():  # a PEFT adapter: its base is referenced, not held
        out["model_class"] = ADAPTER
    else:
        config = json.loads((root / "model" / "config.json").read_text())
        out["model_class"] = (config.get("architectures") or ["AutoModel"])[0]
    return out


def _pack_run(led: Ledger, run: dict, root: Path) -> dict:
    """Fill ``root`` with one run's model, config, lock, raw metrics, control set and README: files of the run's
    folder, plain and inside it, and the spec file and factory module the ledger recorded; the rest is named."""
    folder = Path(run["out_dir"] or "")
    meta = json.loads(run.get("meta_json") or "{}")
    lock = json.loads(run.get("lock_json") or "null") or {}
    root.mkdir(parents=True)
    left_out: list[LeftOut] = []
    model: dict = {"left": [], "factory": None, "model_class": None, "recorded": None}
    no_model = None
    if (folder / "export" / MANIFEST).is_file():
        model = _pack_model(led, run, meta, lock, root, left_out)
    else:
        no_model = _why_no_model(run, meta, led)
    control, control_n = _control_files(run, folder), None
    if control and not no_model:
        _copy_run_file(control[0], root / "control" / "inputs.safetensors", folder)
        _copy_run_file(control[1], root / "control" / "outputs.safetensors", folder)
        from safetensors import safe_open

        with safe_open(str(root / "control" / "inputs.safetensors"), framework="pt") as fh:
            first = next(iter(fh.keys()), None)
            control_n = f"{fh.get_slice(first).get_shape()[0]} examples" if first else "empty"
        if (folder / "predictions.json").is_file():
            _copy_run_file(folder / "predictions.json", root / "control" / "predictions.json", folder)
        shutil.copy2(RERUN_SCRIPT, root / "rerun_control.py")
    (root / "config").mkdir()
    if run["spec_path"]:  # the spec file the run row names: a plain file in its own folder, never through a link
        spec_file = Path(run["spec_path"])
        copy_or_name(spec_file, root / "config" / spec_file.name, spec_file.parent, left_out)
    for cand in (folder / "spec.json", folder / "workers" / "spec.json"):
        if cand.is_file():
            _copy_run_file(cand, root / "config" / "spec.json", folder)
            break
    if meta.get("campaign_id") and (folder.parent / "campaign.json").exists():
        copy_or_name(folder.parent / "campaign.json", root / "config" / "campaign.json", folder.parent, left_out)
    (root / "lock.json").write_text(json.dumps(lock, indent=1, sort_keys=True))
    (root / "run.json").write_text(json.dumps({**{k: v for k, v in run.items() if k not in ("lock_json", "meta_json")},
                                               "meta": meta, "recorded": model["recorded"]}, indent=1, default=str))
    _write_tables(led, run["run_id"], root, ("metrics", "gates", "notes"))
    files = _hashes(root)
    readme = _readme(run, meta, lock, model["model_class"], no_model, model["factory"], files, control_n)
    (root / "README.md").write_text(readme + _left_out_lines(left_out))
    return {"run_id": run["run_id"], "model": not no_model, "why_no_model": no_model, "files": len(files) + 1,
            "left_out": model["left"], "not_packed": [x.text() for x in left_out]}


def _left_out_lines(left_out: list[LeftOut]) -> str:
    if not left_out:
        return ""
    return "\n".join(["", "## Left out", "", "Not in this archive (pilotrun packs only the run's own plain files and "
                      "the spec file and factory module its ledger recorded):", "",
                      *[f"- `{x.path}`: {x.why}" for x in left_out]]) + "\n"


def _write_tables(led: Ledger, ref: str, root: Path, which: tuple[str, ...]) -> None:
    for name in which:
        cols, rows = table(led, name, run=ref)
        with open(root / f"{name}.csv", "w", newline="") as fh:
            write_csv(fh, cols, rows)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _tar(root: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a crash mid-write never leaves a plausible archive
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    os.replace(partial, out)


def _campaign_readme(camp: dict, meta: dict, packed: list[dict], gone: dict[str, str], runs: list[dict]) -> str:
    conclusion = meta.get("conclusion") or {}
    by_id = {p["run_id"]: p for p in packed}
    lines = [f"# {camp['run_id']}", "",
             f"Campaign `{camp['name']}`: {meta.get('key')} over {json.dumps(meta.get('values'))} (the first is the "
             f"control) x seeds {meta.get('seeds')}, status **{camp['status']}**.", "", "## Conclusion", ""]
    lines += [f"- {t}" for t in conclusion.get("text") or ["no conclusion was recorded (the campaign did not end)"]]
    lines += ["", "`report.html` shows it with every curve; `conclusion.json` holds the numbers.", "",
              "## Every run", "", f"| run | {meta.get('key')} | seed | status | stopped | follows | model |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["meta"]
        if r["run_id"] in gone:
            model = f"folder gone: {gone[r['run_id']]}"
        else:
            p = by_id[r["run_id"]]
            model = "yes" if p["model"] else ("no (stopped)" if m.get("stop_reason") else f"no: {p['why_no_model']}")
        stopped = stop_text(m)
        lines.append(f"| {r['run_id']} | {json.dumps(m.get('variant'))} | {m.get('seed')} | {r['status']} | "
                     f"{stopped} | {link_text(m)} | {model} |")
    lines += ["", "## Files", "",
              "- `runs/RUN_ID/`: one run as `pilotrun archive RUN_ID` writes it (its README says how to reload the "
              "model; `python runs/RUN_ID/rerun_control.py` reruns its control inputs in a fresh process)",
              "- `config/`: the campaign file as written and as run (`campaign.json`)",
              "- `runs.csv`, `metrics.csv`, `gates.csv`, `notes.csv`: the campaign's raw ledger rows, "
              "every run included",
              "- `lock.json`: what the campaign ran on", ""]
    return "\n".join(lines)


def _archive_campaign(led: Ledger, camp: dict, out: Path) -> tuple[Path, dict]:
    from .html import render_campaign

    meta = json.loads(camp.get("meta_json") or "{}")
    runs = led.campaign_runs(camp["run_id"])
    packed, gone = [], {}
    with tempfile.TemporaryDirectory(prefix="pilotrun-archive-") as tmp:
        root = Path(tmp) / camp["run_id"]
        (root / "config").mkdir(parents=True)
        left_out: list[LeftOut] = []
        # The campaign file the row names (in its own folder) and the campaign.json in the campaign's folder: plain
        # files only, never through a link.
        if camp["spec_path"]:
            copy_or_name(Path(camp["spec_path"]), root / "config" / Path(camp["spec_path"]).name,
                         Path(camp["spec_path"]).parent, left_out)
        if camp["out_dir"]:
            copy_or_name(Path(camp["out_dir"]) / "campaign.json", root / "config" / "campaign.json",
                         Path(camp["out_dir"]), left_out)
        (root / "lock.json").write_text(json.dumps(json.loads(camp.get("lock_json") or "null") or {}, indent=1,
                                                   sort_keys=True))
        (root / "conclusion.json").write_text(json.dumps(meta.get("conclusion"), indent=1, default=str))
        _write_tables(led, camp["run_id"], root, ("runs", "metrics", "gates", "notes"))
        (root / "report.html").write_text(render_campaign(led, camp))
        for r in runs:
            if not r["out_dir"] or not Path(r["out_dir"]).is_dir():
                gone[r["run_id"]] = f"{r['out_dir']} no longer exists; its ledger rows are in the CSV files"
                continue
            packed.append(_pack_run(led, r, root / "runs" / r["run_id"]))
        (root / "README.md").write_text(_campaign_readme(camp, meta, packed, gone, runs) + _left_out_lines(left_out))
        files = len(_hashes(root))
        _tar(root, out)
    return out, {"run_id": camp["run_id"], "kind": "campaign", "runs": len(runs),
                 "models": sum(p["model"] for p in packed), "runs_without_folder": sorted(gone), "files": files,
                 "not_packed": [x.text() for x in left_out] + [t for p in packed for t in p["not_packed"]],
                 "bytes": out.stat().st_size}


def archive_run(led: Ledger, ref: str, out: Path | None = None) -> tuple[Path, dict]:
    """Write the archive of a run or a whole campaign; returns its path and a summary."""
    run = led.run(ref)
    if run is None:
        raise ArchiveError(f"no run {ref!r} in {led.path}; see `pilotrun ledger`")
    out = Path(out or f"{run['run_id']}.tar.gz")
    if run["kind"] == "campaign":
        return _archive_campaign(led, run, out)
    folder = Path(run["out_dir"] or "")
    if not run["out_dir"] or not folder.is_dir():
        raise ArchiveError(f"the run's folder {folder} is gone; nothing to archive but its ledger rows "
                           f"(`pilotrun ledger --csv metrics --run {run['run_id']}`)")
    with tempfile.TemporaryDirectory(prefix="pilotrun-archive-") as tmp:
        summary = _pack_run(led, run, Path(tmp) / run["run_id"])
        _tar(Path(tmp) / run["run_id"], out)
    return out, {**summary, "kind": run["kind"], "bytes": out.stat().st_size}

