"""examples/llama-8b-adapters: the README's hand arithmetic (hand.py) against the estimate, on the example's own
specs shrunk to 2 layers and length 256 (the rules are per layer and per token, so they hold at any size; the
full-size numbers are in the README). Tolerance, as the README states: training state exact, steady-step peak
within ±10%."""
from __future__ import annotations

import importlib.util

import pytest
import yaml

from pilotrun.config import load_spec
from pilotrun.estimate.trace import trace_job
from pilotrun.models.quiet import QuietTransformers
from tests.conftest import EXAMPLES

FOLDER = EXAMPLES / "llama-8b-adapters"
SHRINK = {"model.config.num_hidden_layers": 2, "data.max_length": 256, "eval.max_length": 256}


def _hand():
    spec = importlib.util.spec_from_file_location("hand", FOLDER / "hand.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hand


@pytest.mark.parametrize("name", ["full", "lora", "qlora"])
def test_hand_arithmetic_matches_the_estimate(name):
    raw = yaml.safe_load((FOLDER / f"{name}.yaml").read_text())
    raw["model"]["config"]["num_hidden_layers"] = SHRINK["model.config.num_hidden_layers"]
    raw["data"]["max_length"] = raw["eval"]["max_length"] = 256
    hand = _hand()(raw)
    spec = load_spec(FOLDER / f"{name}.yaml", [f"{k}={v}" for k, v in SHRINK.items()], check_files=False)
    with QuietTransformers():
        trace = trace_job(spec, target="cuda").to_dict()
    assert trace["trainable_parameters"] == hand["trainable_parameters"]
    assert trace["adaptation"]["base_parameters"] == hand["parameters"]
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert trace[key] == hand[key], key
    if "quantized_bytes" in hand:
        assert trace["adaptation"]["quantized_bytes"] == hand["quantized_bytes"]
        assert trace["adaptation"]["quant_state_bytes"] == hand["quant_state_bytes"]
    # The bytes as FSDP2 moves them (strategies/fsdp.py): every parameter byte once, in two identical blocks and the
    # root; a quantised base's state all in the blocks (the head is not quantised), its packed weights as stored.
    parts = trace["fsdp_parts"]
    model, block, root = parts["model"], parts["block"], parts["root"]
    assert model["fp32"] + model["stored"] + model["state"] == trace["parameter_bytes"]
    assert model["trainable"] == trace["gradient_bytes"]
    assert all(model[k] == 2 * block[k] + root[k] for k in model)
    assert model["state"] == hand.get("quant_state_bytes", 0) and root["state"] == 0
    if "quantized_bytes" in hand:
        assert block["stored"] >= (hand["quantized_bytes"] - hand["quant_state_bytes"]) // 2
    peak = trace["stages"]["steady_step"]["peak_bytes"]
    assert abs(peak / hand["steady_step_bytes"] - 1) <= 0.10, (peak, hand["steady_step_bytes"])
