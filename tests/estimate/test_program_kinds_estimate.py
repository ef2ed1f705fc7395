"""Every kind of program the integrations accept is described and estimated (issue 44, 3): sequence classification
(with and without class names in its config), token classification, a causal LM and an encoder-decoder (T5-like),
each a tiny model built from a config in this process, described from its objects, turned into the estimate's spec
and traced; and pilotrun's own exception in a trace is exit 3 with a log that outlives the command."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)

from pilotrun.config.load import spec_from_mapping
from pilotrun.config.schema import SpecError
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.model import estimate_fit
from pilotrun.estimate.program_job import job_spec
from pilotrun.estimate.trace import trace_job
from pilotrun.program.describe import describe_objects


def _bert(**kw) -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, **kw)


def _seq_labelled():
    return BertForSequenceClassification(_bert(id2label={0: "neg", 1: "neutral", 2: "pos"},
                                               label2id={"neg": 0, "neutral": 1, "pos": 2}))


def _seq_unlabelled():
    return BertForSequenceClassification(_bert())  # transformers' own LABEL_0, LABEL_1


def _token():
    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    return BertForTokenClassification(_bert(id2label=dict(enumerate(names)), label2id={n: i for i, n in
                                                                                       enumerate(names)}))


def _t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_decoder_layers=1, num_heads=4, decoder_start_token_id=0))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2))


KINDS = [(_seq_labelled, "seq-classification", ["neg", "neutral", "pos"]),
         (_seq_unlabelled, "seq-classification", ["LABEL_0", "LABEL_1"]),
         (_token, "token-classification", ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]),
         (_t5, "seq2seq-lm", None),
         (_gpt2, "causal-lm", None)]


def _estimated(model: torch.nn.Module, drop: tuple[str, ...] = ()) -> tuple:
    """The program's facts -> the estimate's spec -> a CPU trace and a fit on one catalog accelerator."""
    facts = describe_objects(model, torch.optim.AdamW(model.parameters(), lr=1e-4), micro_batch_size=2,
                             grad_accum_steps=2, max_length=16, updates=10)
    for key in drop:
        facts.config.pop(key, None)
    spec, provenance = job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
    trace = trace_job(spec, target="cpu")
    fit = estimate_fit(trace.to_dict(), next(iter(load_catalog().values())), "single", 1)
    return facts, spec, provenance, trace, fit


@pytest.mark.parametrize(("build", "head", "labels"), KINDS, ids=[k[0].__name__.strip("_") for k in KINDS])
def test_each_program_kind_is_described_and_estimated(build, head, labels):
    torch.manual_seed(0)
    model = build()
    facts, spec, provenance, trace, fit = _estimated(model)
    assert facts.head == head and spec.data.task == head
    assert spec.data.labels == labels
    # The trace built the program's own kind of model: the same parameters, its head included (a causal-LM head on
    # a BERT config, or a 2-class head for 5 classes, would count others).
    assert trace.parameters == sum(p.numel() for p in model.parameters()), (trace.parameters, head)
    assert trace.stages["steady_step"].peak_bytes > 0 and trace.stages["eval"].peak_bytes > 0
    assert fit["peak_allocated_bytes"] > 0 and fit["fits"] is True
    assert {f.key: f.source.value for f in provenance}["data.task"] == "program"


def test_a_classification_config_without_class_names_is_estimated_with_its_own_head():
    """A described config with no id2label (a hand-trimmed config, a model class that keeps none): no data.labels,
    and the head is the config's own default size."""
    facts, spec, provenance, trace, _fit = _estimated(_seq_unlabelled(), drop=("id2label", "label2id"))
    assert "id2label" not in facts.config and spec.data.labels is None
    assert "data.labels" not in {f.key for f in provenance}
    assert trace.parameters == sum(p.numel() for p in _seq_unlabelled().parameters())


def test_a_shape_only_task_is_refused_where_data_is_read():
    """token-classification and seq2seq-lm are shapes for the estimate; a pilot reading JSONL gets the fix named."""
    raw = {"name": "p", "model": {"config": {"model_type": "bert", "hidden_size": 32}},
           "data": {"task": "token-classification", "max_length": 16, "path": "d.jsonl"},
           "train": {"micro_batch_size": 2, "updates": 2, "optimizer": {"name": "adamw", "lr": 1e-4}}}
    with pytest.raises(SpecError) as err:
        spec_from_mapping(raw, "x/pilot.yaml")
    problems = dict(err.value.problems)
    assert "data.factory" in problems["data.task"] and "estimate, select and plan" in problems["data.task"]
    assert spec_from_mapping(raw, "x/pilot.yaml", check_files=False).data.task == "token-classification"


def _worker_in_process(module, args, result, log, what, timeout=0, nproc=1):
    """run_worker with the trace worker's own main() in this process (the same result file and log a subprocess
    writes), so that a bug planted in this process is the one the trace meets."""
    import contextlib
    import io

    from pilotrun.estimate import worker
    from pilotrun.workers.launch import _read_result

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = worker.main([*args, "--result", str(result)])
    log.write_text(out.getvalue() + f"trace worker exited with {code}\n")
    return _read_result(result, log, what, code)


def _run_estimate(tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    from pilotrun.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PILOTRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pilotrun.workers.launch.run_worker", _worker_in_process)
    spec = tmp_path / "pilot.yaml"
    spec.write_text("name: p\nmodel:\n  config: {model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, vocab_size: 64,"
                    " n_positions: 64}\ndata: {task: causal-lm, max_length: 16}\ntrain: {micro_batch_size: 2, "
                    "updates: 2, optimizer: {name: adamw, lr: 0.0001}}\n")
    code = main(["estimate", str(spec), "--accelerator", next(iter(load_catalog())), "--no-trace-cache"])
    return code, " ".join(capsys.readouterr().err.split())


def _path_in(said: str, before: str, suffix: str) -> Path | None:
    """The path after ``before`` in a message the console wrapped (a long path may be cut by a line break
    anywhere): matched with every space taken out, as no path here holds one."""
    found = re.search(re.escape(before.replace(" ", "")) + r"(/\S+?" + re.escape(suffix) + ")", "".join(said.split()))
    return Path(found.group(1)) if found else None


def test_pilotruns_own_exception_in_a_trace_is_exit_3_with_a_log_that_exists(tmp_path, monkeypatch, capsys):
    """A bug in pilotrun's trace (the id2label keyword passed twice, issue 44) is an internal error: exit 3, the
    traceback saved, and the trace's log named in the message still there after the command ended."""
    # pilotrun's own frame calls what is not callable: the kind of fault a bug in its code raises.
    monkeypatch.setattr("pilotrun.estimate.trace.largest_block", None)
    code, said = _run_estimate(tmp_path, monkeypatch, capsys)
    assert code == 3, said
    assert "internal error" in said and "TypeError" in said and "bad spec" not in said, said
    kept = _path_in(said, "(log ", ".log")
    assert kept is not None, said
    assert kept.is_file() and kept.is_relative_to(tmp_path / "cache"), kept
    assert "Traceback" in kept.read_text() and "largest_block" in kept.read_text()
    crash = _path_in(said, "traceback saved to ", ".txt")
    assert crash is not None and crash.is_file(), said


def test_a_trace_that_fails_on_the_users_config_is_exit_2_naming_a_log_that_exists(tmp_path, monkeypatch, capsys):
    """The same path when transformers refuses what the user wrote (not pilotrun's bug): exit 2, the log kept."""
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("n_embd must be divisible by n_head")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", refuse)
    code, said = _run_estimate(tmp_path, monkeypatch, capsys)
    assert code == 2 and "model.config" in said and "divisible" in said, said
    log = _path_in(said, "(log ", ".log")
    assert log is not None and log.is_file(), said


def test_a_bad_call_in_the_config_builder_is_pilotruns_and_a_refused_config_is_the_users(monkeypatch):
    """A TypeError raised by pilotrun's own call (its arguments: the id2label passed twice of issue 44) propagates as
    pilotrun's; one raised inside transformers on the user's values stays a ModelError naming model.config."""
    import transformers

    from pilotrun.models import loading
    from pilotrun.models.loading import ModelError, build_model

    spec = spec_from_mapping({"name": "p", "model": {"config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                                "n_head": 2, "vocab_size": 64}},
                              "data": {"task": "causal-lm", "max_length": 16},
                              "train": {"micro_batch_size": 2, "updates": 2, "optimizer": {"name": "adamw", "lr": 1e-4}}},
                             "x/pilot.yaml", check_files=False)
    monkeypatch.setattr(loading, "_label_kwargs", lambda head, names: None)  # `config | None` in pilotrun's frame
    with pytest.raises(TypeError):
        build_model(spec.model, spec.build_context(), None, meta=True)
    monkeypatch.undo()

    def refuse(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for //: 'str' and 'int'")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", refuse)
    with pytest.raises(ModelError, match="model.config: transformers cannot build a 'gpt2' config"):
        build_model(spec.model, spec.build_context(), None, meta=True)
