"""model.quantization.prepare: whether the job runs peft's prepare_model_for_kbit_training (its fp32 upcast of the
base's unquantised weights: embeddings, norms, output head) or not (those weights stay in the compute dtype).

pilotrun's loop builds each with a real bitsandbytes base on this CPU, the trace matches it under the same tracker,
the estimate's adapter line says which preparation it modelled, and describe reads it from a program's model.
"""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import SpecError, load_spec
from pilotrun.estimate.experiments import adapter_line, adapter_view
from pilotrun.estimate.trace import trace_job
from pilotrun.models.loading import build_model
from pilotrun.models.quiet import QuietTransformers
from pilotrun.program.describe import describe_objects, kbit_preparation
from tests.conftest import EXAMPLES, require

bnb = require("bitsandbytes", "bitsandbytes")

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def qlora(prepare: str | None, *sets: str):
    quant = "{bits: 4}" if prepare is None else f"{{bits: 4, prepare: {prepare}}}"
    return load_spec(TINY, ["train.grad_accum_steps=1", "train.precision=bf16", "model.adapter={r: 8}",
                            f"model.quantization={quant}", *sets], check_files=False)


def unquantised_dtypes(model) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if p.is_floating_point() and ".lora_" not in n}


def test_the_key_defaults_to_peft_and_is_checked():
    assert qlora(None).model.quantization.prepare == "peft"
    assert qlora("none").model.quantization.prepare == "none"
    with pytest.raises(SpecError, match="model.quantization.prepare"):
        qlora("kbit")


def test_the_loop_the_trace_and_describe_hold_the_unquantised_weights_as_prepared():
    from tests.estimate.test_estimate_adapters import measure_real

    seen = {}
    for prepare in ("peft", "none"):
        spec = qlora(prepare)
        with QuietTransformers():
            loaded = build_model(spec.model, spec.build_context())
            trace = trace_job(spec, target="cpu").to_dict()
        assert unquantised_dtypes(loaded.model) == {torch.float32 if prepare == "peft" else torch.bfloat16}
        assert any(("prepared with peft" if prepare == "peft" else "prepare: none") in n for n in loaded.notes)
        assert trace["adaptation"]["preparation"].startswith(prepare)
        assert any(n.startswith(f"QLoRA preparation modelled: {prepare}") for n in trace["notes"])
        view = adapter_view(trace, spec)
        assert view is not None
        assert f"QLoRA preparation {prepare} (model.quantization.prepare: {prepare})" in adapter_line(view)
        # describe, on the program's model once built: the dtypes say which preparation ran.
        facts = describe_objects(loaded.model, precision="bf16", precision_source="TrainingArguments.bf16")
        assert facts.quantization is not None and facts.quantization["prepare"] == prepare
        note = next(n for n in facts.notes if n.startswith("model.quantization.prepare:"))
        assert ("float32, as prepare_model_for_kbit_training leaves them" in note if prepare == "peft"
                else "bfloat16: prepare_model_for_kbit_training did not run" in note), note
        seen[prepare] = trace
    # The trace against the loop under the same tracker (prepare: peft is tests/estimate/test_estimate_adapters.py's case).
    with QuietTransformers():
        real = measure_real(qlora("none"))
    for stage in ("first_step", "steady_step"):
        est = seen["none"]["stages"][stage]["peak_bytes"]
        assert abs(est / real[stage] - 1) < 0.01, (stage, est, real[stage])
    # Without the upcast the embeddings (tied head) and norms are 2 bytes a value, not 4: less memory.
    c = qlora("none").model.config
    saved = (c["vocab_size"] * c["hidden_size"] + (2 * c["num_hidden_layers"] + 1) * c["hidden_size"]) * 2
    assert seen["peft"]["parameter_bytes"] - seen["none"]["parameter_bytes"] == saved
    assert seen["none"]["stages"]["steady_step"]["peak_bytes"] < seen["peft"]["stages"]["steady_step"]["peak_bytes"]


def test_an_8bit_base_not_prepared_takes_its_weights_dtype_as_compute_dtype():
    # An 8-bit base has no compute dtype of its own: the one its unquantised weights hold becomes it.
    fp16 = torch.nn.Linear(4, 4).to(torch.float16)
    eight = {"bits": 8}
    assert kbit_preparation(fp16, eight)[0] == "none" and eight["compute_dtype"] == "fp16"
    assert kbit_preparation(torch.nn.Linear(4, 4), {"bits": 8})[0] == "peft"
