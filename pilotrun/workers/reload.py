"""Reload the exported artifact with nothing from training, run the control inputs, write the outputs.

    python -m pilotrun.workers.reload --export DIR --inputs IN.safetensors --outputs OUT.safetensors --result R.json
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.trust import LoadPolicy
from ..train.evaluation import outputs_of
from .common import write_result


def load_artifact(folder: Path, policy: LoadPolicy, spec_folder: Path | None = None) -> torch.nn.Module:
    """The exported model, admitted by the loading policy first: a factory is imported only when the export is
    known or it is the one named on the command line (then from ``spec_folder``, not from the artifact)."""
    adm = policy.admit(folder)
    factory = policy.export_factory(adm)
    if factory is not None:
        from safetensors.torch import load_model

        from ..config.spec import import_factory

        info = json.loads((folder / "export.json").read_text())
        where = spec_folder if spec_folder is not None and factory == policy.factory else Path(info["spec_folder"])
        torch.manual_seed(0)
        model = import_factory(factory, where)(info["model"])
        load_model(model, str(folder / "model.safetensors"))
        return model
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise RuntimeError(f"{folder}/config.json names no loadable architecture ({arch!r})")
    # trust_remote_code stays False: a Hub-style folder's own code is never run.
    return cls.from_pretrained(str(folder), use_safetensors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.reload")
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--inputs", type=Path, required=True)
    ap.add_argument("--outputs", type=Path, required=True)
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--factory", help="module:function the user named (the spec's model.factory)")
    ap.add_argument("--spec-folder", type=Path, help="where --factory is imported from")
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    try:
        policy = LoadPolicy.of(args.known_manifest, trust=False, factory=args.factory)
        model = load_artifact(args.export, policy, args.spec_folder)
        batch = load_file(str(args.inputs))
        save_file({"outputs": outputs_of(model, batch).contiguous()}, str(args.outputs))
        write_result(args.result, {"model_class": type(model).__name__})
        return 0
    except Exception as exc:  # reported to the gate, which names it in its row
        write_result(args.result, {"error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()[-4000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
