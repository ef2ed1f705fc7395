"""Reload the exported artifact with nothing from training, run the control inputs, write the outputs.

    python -m pilotrun.workers.reload --export DIR --inputs IN.safetensors --outputs OUT.safetensors --result R.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.export import BASE_JSON, MERGED
from ..checkpoint.pinned import pinned
from ..checkpoint.trust import Admission, LoadPolicy, LoadRefused, Refusal, verified_bytes
from ..train.batches import HALF_DTYPES, cast_floats, dtype_names
from ..train.evaluation import outputs_of
from .common import write_error, write_result


def load_adapter_artifact(adm: Admission, policy: LoadPolicy) -> torch.nn.Module:
    """An exported adapter on its rebuilt base: the base from the spec ``base.json`` records (pilotrun's one builder,
    the adapter removed), the adapter from ``adapter_model.safetensors`` by peft (safetensors, never a pickle), and
    the base's identity checked against the one the training job recorded."""
    import dataclasses

    from peft import PeftModel

    from ..config.load import spec_from_mapping
    from ..models.adapters import base_identity
    from ..models.loading import build_model

    folder = adm.folder
    try:
        base = json.loads(verified_bytes(adm, BASE_JSON))
        spec = spec_from_mapping(base["spec"]["written"], base["spec"]["source"], check_files=False)
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadRefused(Refusal.DAMAGED, f"{folder / BASE_JSON}: field 'spec' is unreadable "
                                           f"({type(exc).__name__}: {exc})") from None
    policy.admit_base(adm, spec.model.factory, spec.model.trust_remote_code)
    base_model = dataclasses.replace(spec.model, adapter=None)
    tokenizer = None
    if base.get("head") == "seq-classification" and "tokenizer.json" in adm.manifest["files"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    built = build_model(base_model, spec.build_context(), base.get("label_names"), tokenizer, device="cpu")
    keep = spec.train.precision == "bf16-true"  # the adapter stays in bf16 as trained, not upcast by peft
    model = PeftModel.from_pretrained(built.model, str(folder), is_trainable=False, autocast_adapter_dtype=not keep)
    got = base_identity(model)
    if got != base.get("base_identity"):
        want = str(base.get("base_identity"))[:12]
        raise RuntimeError(f"the base rebuilt from {folder / BASE_JSON} (sha256 {got[:12]}…) is not the one the "
                           f"adapter was trained on ({want}…): {base.get('how_to_load')}")
    return model


def load_artifact(folder: Path, policy: LoadPolicy, spec_folder: Path | None = None) -> torch.nn.Module:
    """The exported model (see :func:`load_artifacts`)."""
    return load_artifacts(folder, policy, spec_folder)[0]


def load_artifacts(folder: Path, policy: LoadPolicy, spec_folder: Path | None = None,
                   merged: bool = False) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The exported model (and with ``merged`` the merged copy inside an adapter export), admitted by the loading
    policy first and read from a pinned view of it: every file used is the one whose digest was checked. A factory
    is imported only when the export is known or it is the one named on the command line (then from
    ``spec_folder``, not from the artifact). An adapter export (``base.json``) is loaded onto its rebuilt base."""
    policy.admit(folder)
    with pinned(folder) as view:
        model = _load_admitted(view, policy, spec_folder)
        return model, (load_hf_folder(view.folder / MERGED) if merged else None)


def _load_admitted(adm: Admission, policy: LoadPolicy, spec_folder: Path | None) -> torch.nn.Module:
    if BASE_JSON in adm.manifest["files"]:
        return load_adapter_artifact(adm, policy)
    factory = policy.export_factory(adm)
    if factory is not None:
        from safetensors.torch import load_model

        from ..config.factories import import_factory

        info = json.loads(verified_bytes(adm, "export.json"))  # the bytes export_factory checked
        where = spec_folder if spec_folder is not None and factory == policy.factory else Path(info["spec_folder"])
        torch.manual_seed(0)
        model = import_factory(factory, where)(info["model"])
        load_model(model, str(adm.folder / "model.safetensors"))
        return model
    return load_hf_folder(adm.folder)


def load_hf_folder(folder: Path) -> torch.nn.Module:
    """A Hugging Face model folder (config + safetensors) by the architecture its config names; no remote code."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise RuntimeError(f"{folder}/config.json names no loadable architecture ({arch!r})")
    # trust_remote_code stays False: a Hub-style folder's own code is never run.
    return cls.from_pretrained(str(folder), use_safetensors=True)


def compute_like_fsdp(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run ``model`` as FSDP2's MixedPrecisionPolicy(param_dtype=dtype) runs it under pilotrun's fsdp strategy: its
    float parameters in ``dtype`` (buffers as stored), and the float inputs of the root and of every repeated block
    (the modules ``FSDP.wrap`` shards: ``cast_forward_inputs``) cast to it, so a float32 buffer added to the residual
    stream is cast back at the next block as it was in training."""
    from ..models.structure import repeated_blocks

    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)

    def cast_inputs(module, args, kwargs):
        return cast_floats(tuple(args), dtype), cast_floats(dict(kwargs), dtype)

    for module in (model, *repeated_blocks(model)[1]):
        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)


def outputs_computed_in(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None) -> torch.Tensor:
    """``outputs_of`` the model; with ``dtype``, under autocast to it on the CPU, as the job's model computed them
    (its own modules outside the blocks, an fp32 head after an fp32 residual stream, take their inputs so)."""
    if dtype is None:
        return outputs_of(model, batch)
    with torch.autocast("cpu", dtype=dtype):
        return outputs_of(model, batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pilotrun.workers.reload")
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--inputs", type=Path, required=True)
    ap.add_argument("--outputs", type=Path, required=True)
    ap.add_argument("--known-manifest", action="append", default=[])
    ap.add_argument("--factory", help="module:function the user named (the spec's model.factory)")
    ap.add_argument("--spec-folder", type=Path, help="where --factory is imported from")
    ap.add_argument("--remote-code", action="store_true",
                    help="the job's own spec sets model.trust_remote_code (an artifact's base.json never can)")
    ap.add_argument("--merged-outputs", type=Path, help="also run the merged model (merged/ inside the export)")
    ap.add_argument("--param-dtype", choices=sorted(HALF_DTYPES),
                    help="run with the float parameters (and float inputs) in this dtype under autocast to it, as the "
                         "job's model computed (FSDP2 gathering fp32 master weights in bf16); buffers stay as stored")
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    try:
        policy = LoadPolicy.of(args.known_manifest, trust=False, factory=args.factory, remote_code=args.remote_code)
        # merged/ is inside the admitted folder (its files are in the manifest just checked): a plain HF folder.
        model, merged = load_artifacts(args.export, policy, args.spec_folder, merged=args.merged_outputs is not None)
        batch = load_file(str(args.inputs))
        stored = dtype_names(p for p in model.parameters() if p.is_floating_point())
        dtype = HALF_DTYPES[args.param_dtype] if args.param_dtype is not None else None
        if dtype is not None:
            for m in (model, merged):
                if m is not None:
                    compute_like_fsdp(m, dtype)
        save_file({"outputs": outputs_computed_in(model, batch, dtype).contiguous()}, str(args.outputs))
        result = {"model_class": type(model).__name__, "stored_float_dtypes": stored}
        if merged is not None:
            save_file({"outputs": outputs_computed_in(merged, batch, dtype).contiguous()}, str(args.merged_outputs))
            result["merged_class"] = type(merged).__name__
        write_result(args.result, result)
        return 0
    except Exception as exc:  # reported to the gate, which names it in its row
        write_error(args.result, exc)
        return 1


if __name__ == "__main__":
    from ..procs import quiet_import_noise

    quiet_import_noise()  # torchao's import warnings (through transformers') are not this job's
    sys.exit(main())
