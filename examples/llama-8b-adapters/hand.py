"""The hand arithmetic of README.md, as code: what `pilotrun estimate` should print for full.yaml, lora.yaml and
qlora.yaml, worked out from the config with nothing but multiplication (no torch, no pilotrun).

    python examples/llama-8b-adapters/hand.py            # the three specs, in GB

Rules (README.md says where each number comes from):
  parameters      embeddings + output head + per layer (q, k, v, o, gate, up, down, two norms) + final norm
  LoRA            r x (in + out) per adapted Linear (all-linear: the seven projections of every layer)
  4-bit base      per quantised Linear of n weights: n/2 packed bytes + n/64 absmax bytes (uint8, double quant)
                  + n/64/256 x 4 second-level absmax + 1,092 bytes of maps and offset
  optimizer       AdamW: 2 moments in the parameter's dtype (+ a 4-byte step per tensor);
                  8-bit AdamW: 2 bytes per value + 2 x 4 bytes per 256 values (+ 2 KiB of maps)
  activations     with checkpointing at micro batch b, length s: every layer's input (b s h x residual bytes),
                  the logits (b s V x (lm_head dtype + 3 x 4): the output, its fp32 copy, log-softmax and its
                  gradient at the start of backward), and one layer recomputed in backward
                  (b s (4h + 2 kv + 3 I) x compute bytes)
  weight casts    bf16 autocast's copies of the fp32 weights a matmul used (2 bytes each): the output head and
                  the LoRA matrices (every Linear for a full fine-tune), kept for backward
  step            fused AdamW (pilotrun's choice on CUDA) has no step temporaries; the foreach path
                  (optimizer.fused: false) holds one parameter-sized list of them: the peak is then the larger of
                  the backward moment and the step moment
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def shapes(cfg: dict) -> dict:
    h, i, heads, kv_heads = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                             cfg["num_key_value_heads"])
    kv = h // heads * kv_heads
    # (in, out) of the seven projections of one layer
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    return {"h": h, "i": i, "kv": kv, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
            "linears": linears, "tied": cfg.get("tie_word_embeddings", False)}


def hand(spec: dict) -> dict:
    """Bytes of one device's training state and a steady-step peak for a spec mapping (as in the YAML)."""
    s = shapes(spec["model"]["config"])
    train = spec["train"]
    h, L, V = s["h"], s["layers"], s["vocab"]
    linear_weights = sum(i * o for i, o in s["linears"]) * L
    embeddings = V * h * (1 if s["tied"] else 2)
    norms = (2 * L + 1) * h
    params = linear_weights + embeddings + norms
    adapter = spec["model"].get("adapter")
    quant = spec["model"].get("quantization")
    precision = train["precision"]
    true_bf16 = precision == "bf16-true"
    # bf16-true holds everything in bf16; otherwise the base is fp32 (a quantised base's unquantised tensors too:
    # peft's prepare_model_for_kbit_training upcasts them)
    base_dtype = "bf16" if true_bf16 else "fp32"
    out: dict = {"parameters": params}
    if adapter is None:
        trainable, trainable_dtype, tensors = params, base_dtype, 7 * L + 2 * L + 1 + (1 if s["tied"] else 2)
        parameter_bytes = params * BYTES[base_dtype]
    else:
        r = adapter["r"]
        trainable = sum(r * (i + o) for i, o in s["linears"]) * L
        trainable_dtype = "bf16" if true_bf16 else "fp32"
        tensors = 2 * 7 * L
        if quant:
            n = [i * o for i, o in s["linears"]]
            quantized = L * sum(k // 2 + k // 64 + (k // 64 // 256) * 4 + 1092 for k in n)
            out["quantized_bytes"] = quantized
            # Of it, what is not the packed weight (absmax, codes): not sharded by FSDP, every rank holds it whole.
            out["quant_state_bytes"] = quantized - L * sum(k // 2 for k in n)
            parameter_bytes = quantized + (embeddings + norms) * BYTES[base_dtype]
        else:
            parameter_bytes = params * BYTES[base_dtype]
        parameter_bytes += trainable * BYTES[trainable_dtype]
        out["adapter_parameters"] = trainable
    opt = train["optimizer"]["name"]
    if opt == "adamw":
        optimizer = 2 * trainable * BYTES[trainable_dtype] + 4 * tensors
    elif opt in ("adamw8bit", "paged_adamw8bit"):
        optimizer = 2 * trainable + 2 * 4 * (trainable // 256) + 2 * 256 * 4
    else:
        raise SystemExit(f"hand.py knows adamw and the 8-bit AdamWs, not {opt}")
    gradients = trainable * BYTES[trainable_dtype]
    # Activations with checkpointing (all three specs use it)
    b, seq = train["micro_batch_size"], spec["data"]["max_length"]
    residual = 4 if base_dtype == "fp32" else 2          # the residual stream keeps the embeddings' dtype
    compute = 4 if precision == "fp32" else 2
    head_bytes = compute if not true_bf16 else 2
    saved_inputs = L * b * seq * h * residual
    logits = b * seq * V * (head_bytes + 3 * 4)
    one_layer = b * seq * (4 * h + 2 * s["kv"] + 3 * s["i"]) * compute
    activations = saved_inputs + logits + one_layer
    # bf16 autocast over fp32 weights keeps a bf16 copy of each weight a matmul used, for backward: the fp32
    # output head, the LoRA matrices, and for a full fine-tune every Linear
    casts = 0
    if precision == "bf16":
        casts = V * h * 2 + (trainable * 2 if adapter else linear_weights * 2)
    # pilotrun runs AdamW fused on CUDA (optimizer.fused: auto): no step temporaries; foreach would hold one
    # parameter-sized list of them
    fused = train["optimizer"].get("fused", "auto") in ("auto", True)
    step_temporaries = trainable * BYTES[trainable_dtype] if opt == "adamw" and not fused else 0
    state = parameter_bytes + gradients + optimizer
    out |= {"trainable_parameters": trainable, "parameter_bytes": parameter_bytes, "gradient_bytes": gradients,
            "optimizer_state_bytes": optimizer, "activation_bytes": activations,
            "weight_cast_bytes": casts, "step_temporary_bytes": step_temporaries,
            "steady_step_bytes": state + max(activations + casts, step_temporaries)}
    return out


def main(argv: list[str]) -> int:
    for name in argv or ["full", "lora", "qlora"]:
        spec = yaml.safe_load((HERE / f"{name}.yaml").read_text())
        got = hand(spec)
        print(f"{name:>6}: " + ", ".join(f"{k} {v / 1e9:.3f} G" if k.endswith("bytes") else f"{k} {v:,}"
                                         for k, v in got.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
