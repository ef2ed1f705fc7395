"""The Lightning reload_eval worker: a fresh process loads the exported checkpoint with Lightning's own loading.

    python -m pilotrun.integrations.lightning_reload --export DIR --known-manifest SHA --module-class mod:Class
        --module-folder DIR --batch-kind dict|tuple --inputs IN.safetensors --outputs OUT.safetensors --result R.json

The folder is admitted by pilotrun's loading policy first (every file against its manifest, the manifest's sha256
the one the export row recorded); the checkpoint is then read by ``Class.load_from_checkpoint(weights_only=True)``
(torch's restricted unpickler: tensors and plain containers only). The class is the one the probing process named
(the program's own module), never one the artifact names.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.pinned import pinned
from ..checkpoint.trust import LoadPolicy
from ..program import env as E
from ..workers.common import write_error, write_result


def _class(spec: str, folder: str):
    module_name, qualname = spec.split(":", 1)
    sys.path.insert(0, folder)
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.integrations.lightning_reload")
    for flag in ("--export", "--known-manifest", "--module-class", "--module-folder", "--inputs", "--outputs",
                 "--result"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--batch-kind", choices=("dict", "tuple"), required=True)
    args = ap.parse_args(argv)
    # This process is not one of the pilot's runs: the program's module it imports must find its handle inert.
    for name in E.ALL:
        os.environ.pop(name, None)
    try:
        from .lightning import CHECKPOINT, step_loss

        LoadPolicy.of([args.known_manifest]).admit(Path(args.export))
        cls = _class(args.module_class, args.module_folder)
        with pinned(Path(args.export)) as view:  # the checkpoint loaded is the file whose digest was checked
            model = cls.load_from_checkpoint(str(view.folder / CHECKPOINT), map_location="cpu", weights_only=True)
        tensors = load_file(args.inputs)
        batch = tensors if args.batch_kind == "dict" else tuple(tensors[k] for k in sorted(tensors, key=int))
        model.eval()
        with torch.no_grad():
            loss = step_loss(model.training_step(batch, 0))
        if loss is None:
            raise RuntimeError("training_step returned no loss")
        save_file({"outputs": loss.detach().float().reshape(1).contiguous()}, args.outputs)
        write_result(args.result, {"model_class": cls.__qualname__})
        return 0
    except Exception as exc:  # reported to the probe, which names it in its row
        write_error(args.result, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
