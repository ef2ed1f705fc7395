"""``inspect``: examples exactly as the loss receives them, and counts over the whole training split.

Fails when prompt tokens are supervised (built-in SFT), when class indices fall
outside the model's outputs or its config names the classes differently, and when
more than ``pilot.inspect.max_unsupervised_share`` of the training examples have no
supervised label left after truncation (any at all warns).
"""
from __future__ import annotations

from ..data.audit import class_problems, render_example, scan_split
from ..ledger.records import GateName
from .base import Gate, GateFailure, Outcome, Product


def model_label_info(spec, label_names) -> tuple[int | None, dict | None, str]:
    """(number of class outputs, id2label) from the model config, without building the model."""
    m = spec.model
    if m.factory is not None:
        return None, None, "factory model: its output size is checked when first_step runs"
    if m.config is not None:
        cfg = m.config
        id2label = cfg.get("id2label")
        n = cfg.get("num_labels") or (len(id2label) if id2label else None)
        return n, id2label, "model.config"
    try:
        from transformers import AutoConfig

        from ..models.loading import local_path

        local = local_path(spec, m.hf)
        config = AutoConfig.from_pretrained(str(local) if local else m.hf, revision=m.revision,
                                            trust_remote_code=m.trust_remote_code)
    except Exception as exc:  # the load gate reports loading problems in full
        return None, None, f"model config not readable here ({type(exc).__name__})"
    id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
    trained_head = id2label and not all(v == f"LABEL_{k}" for k, v in id2label.items())
    return (len(id2label) if trained_head else None), (id2label if trained_head else None), "model config"


def judge(scan: dict, label_names, spec) -> tuple[list[str], list[str], dict]:
    """(problems that fail the gate, warnings, model class info) from a training-split scan."""
    limit = spec.pilot.inspect.max_unsupervised_share
    problems, warnings, info = [], [], {}
    if scan["label_kind"] == "class":
        n_out, id2label, source = model_label_info(spec, label_names)
        info = {"outputs": n_out, "id2label": id2label, "from": source}
        problems += class_problems(scan, label_names, n_out, id2label)
    if scan["prompt_supervised_examples"]:
        problems.append(f"{scan['prompt_supervised_examples']} example(s) train on prompt tokens "
                        f"(e.g. {', '.join(scan['prompt_supervised_ids'][:5])}): prompts must be masked with -100")
    share = scan["unsupervised_share"]
    none_left = (f"{scan['unsupervised_examples']} of {scan['examples']} training examples ({share:.1%}) have no "
                 f"supervised label left after truncation (e.g. {', '.join(scan['unsupervised_ids'][:5])})")
    if share > limit:
        problems.append(f"{none_left}: above pilot.inspect.max_unsupervised_share {limit:.0%}; raise "
                        "data.max_length or truncate prompts, not targets")
    elif scan["unsupervised_examples"]:
        warnings.append(none_left)
    return problems, warnings, info


class InspectGate(Gate):
    name = GateName.INSPECT
    needs = (Product.DATA,)
    produces = (Product.SCAN,)
    carry = True

    def track(self, ctx):
        return []

    def recover(self, ctx, row) -> bool:
        ctx.scan = (row.get("details") or {}).get("scan")
        return ctx.scan is not None

    def describe_inputs(self, ctx) -> dict:
        return {"seq_len": ctx.spec.data.max_length, "examples_shown": ctx.spec.pilot.inspect.examples,
                "rank": ctx.rank, "world_size": ctx.world_size}

    def run(self, ctx, meter) -> Outcome:
        spec, cfg = ctx.spec, ctx.spec.pilot.inspect
        data = ctx.ensure_data()
        views = [render_example(data, data.train[i], "train") for i in range(min(cfg.examples, len(data.train)))]
        scan = scan_split(data, "train", progress=ctx.progress)
        ctx.scan = scan
        out = Outcome(inputs=self.describe_inputs(ctx))
        out.details = {"examples": [{"id": v.id, "text": v.plain(), "input_tokens": v.input_tokens,
                                     "supervised": v.supervised, "padding": v.padding, "batch_keys": v.keys}
                                    for v in views],
                       "scan": scan, "label_names": data.label_names}
        problems, warnings, info = judge(scan, data.label_names, spec)
        if info:
            out.details["model_classes"] = info
        if problems:
            raise GateFailure("; ".join(problems), inputs=out.inputs, details=out.details)
        if scan["label_kind"] == "token":
            out.reason = (f"{scan['examples']} training examples: supervised tokens are "
                          f"{scan.get('supervised_token_share', 0):.0%} of {scan.get('input_tokens', 0):,} input "
                          f"tokens; every example keeps a supervised label")
            if data.task == "causal-lm":
                out.reason += "; prompts masked"
        elif scan["label_kind"] == "class":
            dist = ", ".join(f"{k} {v}" for k, v in scan["label_distribution"].items())
            out.reason = f"{scan['examples']} training examples; classes: {dist}"
        else:
            out.reason = f"{scan['examples']} training examples with non-class targets"
        if spec.model.adapter is not None:
            from ..models.loading import ModelError

            try:
                a = adapter_split(spec, data.label_names)
            except ModelError as exc:  # the load gate reports the build itself
                a = {"not_measured": f"not measured: the model does not build on the meta device ({exc})"}
            out.details["adapter"] = a
            if "trainable_parameters" in a:
                out.reason += (f"; adapter: {a['trainable_parameters']:,} trainable of "
                               f"{a['trainable_parameters'] + a['frozen_parameters']:,} parameters "
                               f"({a['trainable_share']:.2%})")
        for w in warnings:
            out.warn(w)
        return out


def adapter_split(spec, label_names) -> dict:
    """Trainable vs frozen parameters of the adapter job, from the model built on the meta device (no weights, no
    memory). Bytes are at the dtype the job holds them in before quantisation; the load row has the bytes as built
    (a 4-bit base's packed weights)."""
    from ..models.adapters import parameter_split
    from ..models.loading import build_model

    split = parameter_split(build_model(spec, label_names, meta=True, activation_checkpointing=False).model)
    note = ("frozen bytes before quantisation (the load gate measures the quantised base)"
            if spec.model.quantization is not None else "bytes at the dtype the job holds them")
    return {**split.as_dict(), "bytes_note": note}
