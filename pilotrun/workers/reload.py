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

from ..checkpoint.state import check_trusted
from ..train.evaluation import outputs_of
from .common import write_result


def load_artifact(folder: Path) -> torch.nn.Module:
    meta = folder / "export.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        from safetensors.torch import load_model

        from ..config.spec import import_factory

        torch.manual_seed(0)
        model = import_factory(info["factory"], Path(info["spec_folder"]))(info["model"])
        load_model(model, str(folder / "model.safetensors"))
        return model
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise RuntimeError(f"{folder}/config.json names no loadable architecture ({arch!r})")
    return cls.from_pretrained(str(folder))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.reload")
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--inputs", type=Path, required=True)
    ap.add_argument("--outputs", type=Path, required=True)
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    try:
        check_trusted(args.export, set(args.known_manifest) or None, trust=False)
        model = load_artifact(args.export)
        batch = load_file(str(args.inputs))
        save_file({"outputs": outputs_of(model, batch).contiguous()}, str(args.outputs))
        write_result(args.result, {"model_class": type(model).__name__})
        return 0
    except Exception as exc:
        write_result(args.result, {"error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()[-4000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
