"""estimate, select and plan on a program spec: the job's shape read from the program's own objects (issue 20, 1).

Pure tests read real transformers/PEFT/torch objects in this process; the process tests run the real programs in
the describe role (they stop before their first update) and compare with a pilotrun spec written by hand."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from pilotrun.config.schema import SpecError
from pilotrun.estimate.program_job import DescribeError, Source, job_spec, load_job
from pilotrun.program.describe import JobFacts, describe_objects, describe_optimizer
from tests.conftest import EXAMPLES, copy_example, pilotrun_cli, program_events, program_handle, write_spec

sys.path.insert(0, str(EXAMPLES / "hf-trainer"))
import chat  # noqa: E402


def _gpt2(**kw) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, **kw))


def _facts(**kw) -> JobFacts:
    model = _gpt2()
    return describe_objects(model, torch.optim.AdamW(model.parameters(), lr=3e-4), micro_batch_size=4,
                            grad_accum_steps=2, max_length=32, updates=50, **kw)


def test_facts_come_from_the_objects():
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)  # warm-up from 0
    assert opt.param_groups[0]["lr"] == 0.0 and sched is not None
    facts = describe_objects(model, opt, micro_batch_size=8)
    assert facts.model_kind == "transformers" and facts.head == "causal-lm"
    assert facts.parameters == sum(p.numel() for p in model.parameters()) == facts.trainable_parameters
    assert facts.config["n_layer"] == 2 and facts.config["model_type"] == "gpt2"
    assert "transformers_version" not in facts.config and "dtype" not in facts.config
    # The peak lr the warm-up starts from, not the 0 it has set at train begin.
    assert facts.optimizer == {"class": "torch.optim.adamw.AdamW", "name": "adamw", "lr": 2e-3, "weight_decay": 0.1,
                               "eps": 1e-8, "betas": [0.9, 0.95], "fused": True}
    assert facts.precision is None and facts.activation_checkpointing is False
    # bf16 weights without autocast declared: bf16-true, and the reason says so.
    half = describe_objects(_gpt2().to(torch.bfloat16), None, micro_batch_size=1)
    assert half.precision == "bf16-true" and "bfloat16" in half.precision_source
    # bf16 weights under bf16 autocast (TrainingArguments.bf16 on a model loaded in bf16): bf16-true-autocast, the
    # same weights as bf16-true with autocast's fp32 ops over them.
    autocast = describe_objects(_gpt2().to(torch.bfloat16), None, micro_batch_size=1, precision="bf16",
                                precision_source="TrainingArguments.bf16")
    assert autocast.precision == "bf16-true-autocast"
    assert autocast.precision_source == "the parameters are bfloat16 and TrainingArguments.bf16 autocasts over them"
    # A batch gives the micro batch and the length when they are not given.
    batch = {"input_ids": torch.zeros(3, 17, dtype=torch.long)}
    from_batch = describe_objects(model, opt, batch=batch)
    assert (from_batch.micro_batch_size, from_batch.max_length) == (3, 17)
    assert "batch" in from_batch.length_source


def test_optimizers_and_adapters():
    model = _gpt2()
    sgd = describe_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert sgd is not None and (sgd["name"], sgd["momentum"], sgd["fused"]) == ("sgd", 0.9, None)
    adam = describe_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    assert adam is not None and adam["name"] == "adamw" and adam["fused"] is False
    odd = describe_optimizer(torch.optim.RMSprop(model.parameters(), lr=1e-3))
    assert odd is not None and odd["name"] is None and odd["class"] == "torch.optim.rmsprop.RMSprop"

    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(_gpt2(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"]))
    facts = describe_objects(peft, torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-4),
                             micro_batch_size=2, max_length=16)
    assert facts.adapter == {"type": "lora", "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["c_attn"]}
    assert facts.model_class.endswith("GPT2LMHeadModel") and facts.model_kind == "transformers"
    assert 0 < facts.trainable_parameters < facts.parameters
    spec, provenance = job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
    assert spec.model.adapter is not None and spec.model.adapter.r == 4
    assert spec.model.adapter.target_modules == ["c_attn"]


def test_the_spec_and_set_override_the_program_and_assumptions_are_named(tmp_path):
    facts = describe_objects(_gpt2(), torch.optim.RMSprop(_gpt2().parameters(), lr=1e-3), micro_batch_size=4,
                             max_length=32)
    raw = {"name": "p", "program": {"command": "python x.py"},
           "model": {"config": {"n_layer": 24}}, "data": {"max_length": 2048}}
    spec, provenance = job_spec(raw, "x/pilot.yaml", ["data.max_length"], facts)
    assert spec.model.config is not None and spec.model.config["n_layer"] == 24   # the program's config, deeper
    assert spec.model.config["n_embd"] == 32 and spec.model.config["model_type"] == "gpt2"
    assert spec.data.max_length == 2048 and spec.data.task == "causal-lm"
    by_key = {f.key: f for f in provenance}
    assert by_key["data.max_length"].source is Source.SET
    assert by_key["model.config.n_layer"].source is Source.SPEC
    assert by_key["train.micro_batch_size"].source is Source.PROGRAM
    assert by_key["train.updates"].source is Source.ASSUMED and spec.train.updates == 1000
    assert by_key["train.optimizer.name"].source is Source.ASSUMED
    assert "RMSprop" in by_key["train.optimizer.name"].why
    assert by_key["train.grad_accum_steps"].source is Source.ASSUMED

    # A factory the spec names replaces the program's config; the program's training facts stay.
    (tmp_path / "m.py").write_text("def build(**kw):\n    raise NotImplementedError\n")
    raw = {"name": "p", "program": {"command": "python x.py"}, "model": {"factory": "m:build"}}
    spec, provenance = job_spec(raw, tmp_path / "pilot.yaml", [], _facts())
    assert not any(f.key.startswith("model.config") for f in provenance)
    assert spec.model.factory == "m:build" and spec.model.config is None and spec.train.grad_accum_steps == 2


def test_what_neither_gives_is_named_with_the_fix():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    facts = describe_objects(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    with pytest.raises(DescribeError) as err:
        job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
    fields = dict(err.value.problems)
    assert "model.factory" in fields["model"] and "torch.nn.modules.container.Sequential" in fields["model"]
    assert "data.factory" in fields["data"]
    assert "micro_batch_size=" in fields["train.micro_batch_size"]
    no_length = describe_objects(_gpt2(), None, micro_batch_size=2)
    with pytest.raises(DescribeError) as err:
        job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], no_length)
    assert "--set data.max_length" in dict(err.value.problems)["data.max_length"]
    spec, _ = job_spec({"name": "p", "program": {"command": "python x.py"}, "data": {"max_length": 64}},
                       "x/pilot.yaml", [], no_length)
    assert spec.data.max_length == 64


def test_describe_event_and_refused_values(tmp_path):
    job = program_handle(tmp_path, "control")
    model = _gpt2()
    job.describe(model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_batch_size=2, max_length=8)
    job.describe(model, None, precision="fp4")
    [event] = program_events(job, "describe")
    assert event["facts"]["micro_batch_size"] == 2 and event["facts"]["config"]["n_embd"] == 32
    [problem] = program_events(job, "problem")
    assert problem["field"] == "describe" and "fp32, bf16, fp16, bf16-true" in problem["problem"]
    inert = program_handle(tmp_path, "control", program="0")
    inert.describe(model)  # inert: nothing written, nothing raised
    assert not inert.active


def test_load_job_reads_the_spec_and_set_over_a_description(tmp_path):
    spec_path = write_spec(tmp_path / "pilot.yaml", {"name": "p", "program": {"command": "python train.py"},
                                                      "train": {"updates": 500}})
    (tmp_path / "train.py").write_text("")
    seen = []

    def describe(program, refresh):
        seen.append((program.program.words, refresh))
        return _facts(), "described by a stand-in"

    job = load_job(spec_path, ["data.max_length=128", "program.timeout=60"], describe=describe)
    assert seen == [(["python", "train.py"], False)] and job.program.program.timeout == 60
    assert job.spec.train.updates == 500 and job.spec.data.max_length == 128
    assert job.spec.program is not None and job.spec.name == "p"
    values = {v["key"]: v["source"] for v in job.to_dict()["values"]}
    assert values["train.updates"] == "spec" and values["data.max_length"] == "--set"
    assert "piloted_as" not in job.spec.canonical()
    # What the program's own pilots measured is looked up under the hash `pilotrun run` records them under: the spec
    # file with the overrides a pilot takes, not the estimate's sizes.
    from pilotrun.config.load import load_spec

    runnable = write_spec(tmp_path / "run.yaml", {"name": "p", "program": {"command": "python train.py"}})
    job = load_job(runnable, ["data.max_length=128", "program.timeout=60"], describe=describe)
    piloted = load_spec(runnable, ["program.timeout=60"], allow_program=True)
    assert job.spec.pilot_hash() == piloted.config_hash() != job.spec.config_hash()
    with pytest.raises(SpecError) as err:
        load_job(spec_path, ["program.timeout=-1"], describe=describe)
    assert "timeout" in str(err.value)


BARE = textwrap.dedent('''
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import pilotrun

    job = pilotrun.program()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.05)
    batch = {"input_ids": torch.randint(0, 128, (6, 48))}
    if DESCRIBE:
        job.describe(model, opt, batch=batch, grad_accum_steps=4, precision="bf16", updates=300)
    for update in range(1, 4):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        job.update(update, loss=loss, lr=5e-4)
        print("trained update", update, flush=True)
''')


def _bare(folder, describe: bool):
    folder.mkdir()
    (folder / "train.py").write_text(f"DESCRIBE = {describe}\n" + BARE)
    return write_spec(folder / "pilot.yaml", {"name": "bare", "program": {"command": "python train.py"}})


@pytest.mark.process
def test_a_bare_script_is_estimated_from_one_describe_call(tmp_path):
    spec = _bare(tmp_path / "bare", describe=True)
    proc = pilotrun_cli("estimate", str(spec), "--accelerator", "H100-80GB", "--gpus", "2", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    real = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    assert report["model"]["parameters"] == sum(p.numel() for p in real.parameters())
    assert report["model"]["precision"] == "bf16"
    values = {v["key"]: v for v in report["program"]["values"]}
    assert values["train.micro_batch_size"]["value"] == 6 and values["data.max_length"]["value"] == 48
    assert values["train.grad_accum_steps"]["value"] == 4 and values["train.optimizer.weight_decay"]["value"] == 0.05
    assert all(v["source"] == "program" for v in values.values())
    assert "described by running" in report["program"]["described"]
    # The program's train.py is unchanged: the second estimate reads the cached description.
    again = pilotrun_cli("estimate", str(spec), "--accelerator", "H100-80GB", "--gpus", "2", "--json", cwd=tmp_path)
    assert again.returncode == 0 and "cached" in json.loads(again.stdout)["program"]["described"]

    # Without job.describe the describe run stops at the first update and says what to add.
    silent = _bare(tmp_path / "silent", describe=False)
    proc = pilotrun_cli("estimate", str(silent), "--accelerator", "H100-80GB", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "before job.describe" in proc.stderr and "Traceback" not in proc.stderr
    log = proc.stderr.split("(log: ")[-1].split(")")[0].replace("\n", "").strip()
    assert log.endswith(".log") and "trained update" not in open(log).read()  # ended at its first report


@pytest.mark.process
def test_pilotruns_own_fault_inside_the_describe_run_is_exit_3_with_its_traceback_kept(tmp_path):
    """Issue 44, item 3: an integration's describer that fails in pilotrun's own frame (planted: describe_objects
    given no model) is pilotrun's bug — exit 3 naming a log with the traceback, never exit 2 blaming the program."""
    folder = tmp_path / "buggy"
    folder.mkdir()
    (folder / "train.py").write_text("import pilotrun\nfrom pilotrun.program.describe import describe_objects\n"
                                     "job = pilotrun.program()\njob.describe(facts=lambda: describe_objects(None, None))\n")
    spec = write_spec(folder / "pilot.yaml", {"name": "buggy", "program": {"command": "python train.py"}})
    proc = pilotrun_cli("estimate", str(spec), "--accelerator", "H100-80GB", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "a bug in pilotrun, not in the program or the spec" in proc.stderr, proc.stderr
    log = proc.stderr.split("traceback and log: ")[-1].split(")")[0].replace("\n", "").strip()
    assert "AttributeError" in open(log).read() and "describe_objects" in open(log).read()


def test_the_description_is_cached_per_environment_and_program_files(tmp_path, monkeypatch):
    """A cached description answers only for the same files and the same installed libraries: an upgrade (TRL once
    changed its gradient-checkpointing default) or an edit describes the program again."""
    from pilotrun.estimate import program_job

    class Got(Exception):
        pass

    def grab(program, refresh):  # the program part as load_job reads it; no describe run
        raise Got(program)

    with pytest.raises(Got) as got:
        load_job(_bare(tmp_path / "bare", describe=True), describe=grab)
    program = got.value.args[0]
    first = program_job.describe_key(program)
    assert program_job.describe_key(program) == first
    real = program_job.installed_distributions()
    assert "torch" in real and "transformers" in real
    monkeypatch.setattr(program_job, "installed_distributions", lambda: {**real, "transformers": "99.0.0"})
    upgraded = program_job.describe_key(program)
    assert upgraded["distributions"] != first["distributions"]
    assert program_job._cache_path(upgraded) != program_job._cache_path(first)
    monkeypatch.setattr(program_job, "installed_distributions", lambda: real)
    assert program_job.describe_key(program) == first
    (tmp_path / "bare" / "train.py").write_text((tmp_path / "bare" / "train.py").read_text() + "\n# edited\n")
    assert program_job.describe_key(program)["files"] != first["files"]


@pytest.mark.process
def test_select_on_the_trainer_example_matches_the_equivalent_spec(tmp_path):
    """The hf-trainer example's program spec, and a pilotrun spec written by hand from its train.py and chat.py."""
    program = copy_example("hf-trainer", tmp_path)
    hand = write_spec(tmp_path / "equivalent.yaml", {
        "name": "hf-trainer-by-hand",
        "model": {"config": {"model_type": "gpt2", "vocab_size": len(chat.WORDS), "n_positions": 64, "n_embd": 32,
                             "n_layer": 2, "n_head": 2, "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 0,
                             # as the program's config says: no KV cache built in a training forward (its copies
                             # were 2% of this toy's time)
                             "use_cache": False}},
        "data": {"task": "causal-lm", "max_length": max(len(d["input_ids"]) for d in chat.dialogues(96, seed=0))},
        "train": {"micro_batch_size": 4, "grad_accum_steps": 2, "updates": 12,
                  "optimizer": {"name": "adamw", "lr": 1e-3, "fused": True}}})
    accs = ["--accelerator", "H100-80GB", "--accelerator", "A100-80GB"]
    ours = pilotrun_cli("select", str(program), *accs, "--json", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    theirs = pilotrun_cli("select", str(hand), *accs, "--json", cwd=tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    a, b = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert a["program"]["framework"] == "transformers.trainer.Trainer"
    for mine, hand_row in zip(a["rows"], b["rows"], strict=True):
        assert mine["fits"] and hand_row["fits"]
        for key in ("device_used_bytes", "seconds_per_update", "hours_for_planned_updates", "largest_micro_batch"):
            assert mine[key] is not None and mine[key] == pytest.approx(hand_row[key], rel=0.02), key
        assert (mine["strategy"], mine["gpus"], mine["micro_batch_size"]) == (
            hand_row["strategy"], hand_row["gpus"], hand_row["micro_batch_size"])
    # The printed sheet says where the job came from.
    shown = pilotrun_cli("select", str(program), "--accelerator", "H100-80GB", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "from program:" in shown.stdout and "train.micro_batch_size = 4" in shown.stdout
    assert "TrainingArguments" in shown.stdout


def test_the_plan_reads_a_program_pilots_rows_and_claims_only_what_they_measured(tmp_path):
    """A program's pilot is recorded under the program spec's hash; its inspect row (an integration's probe) has no
    time and its save row no bytes (the program's own format): the plan uses what they timed and says the rest."""
    from pilotrun.config import load_spec
    from pilotrun.estimate.plan import pipeline_hours
    from pilotrun.ledger.store import Ledger
    from tests.estimate.test_estimate import synthetic_trace

    spec = load_spec(EXAMPLES / "llama-7b-estimate" / "pilot.yaml", check_files=False)
    spec.piloted_as = "program-spec-hash"
    row = {"gpus": 1, "price_per_gpu_hour": None, "seconds_per_update": 1.0, "utilisation_source": "catalog default",
           "cost_note": None}
    with Ledger(tmp_path / "l.sqlite") as led:
        led.start_run("p", "job", "pilot", config_hash="program-spec-hash")
        for gate, seconds, details in (("inspect", None, {}), ("load", 2.0, {}), ("eval", 0.5, {}),
                                       ("save", 0.1, {"note": "a stage: no bytes"})):
            led.add_gate_row("p", {"gate": gate, "verdict": "pass", "reason": "", "inputs": {}, "memory": {},
                                   "seconds": seconds, "details": details})
        items = {i["item"]: i for i in pipeline_hours(spec, row, synthetic_trace(), led)["items"]}
    assert items["preprocessing and load"]["hours"] == pytest.approx(2.0 / 3600)
    assert items["preprocessing and load"]["from"] == "measured by pilot p (load)"
    assert "measured by pilot p" in items["validation"]["from"]
    assert items["checkpoints"]["from"].endswith("(assumed: pilot p's save row has no bytes written (the program's "
                                                 "own checkpoint))")


def test_the_programs_attention_implementation_is_what_the_trace_models():
    """Issue 42: the kernel the program's model runs (its config's _attn_implementation) goes into the estimate's
    spec; one the estimator does not model is traced as sdpa's kernel, and the provenance says so."""
    for impl, expected, source in (("eager", "eager", Source.PROGRAM), ("sdpa", "sdpa", Source.PROGRAM),
                                   ("flex_attention", "sdpa", Source.ASSUMED)):
        model = _gpt2()
        model.config._attn_implementation = impl
        facts = describe_objects(model, None, micro_batch_size=2, max_length=16)
        assert facts.attn_implementation == impl
        spec, provenance = job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
        by_key = {f.key: f for f in provenance}
        assert spec.model.attn_implementation == expected
        assert by_key["model.attn_implementation"].source is source, impl
        if source is Source.ASSUMED:
            assert "flex_attention" in by_key["model.attn_implementation"].why


@pytest.mark.parametrize("policy", ["full", "selective", "selective-2", "every-2"])
def test_the_programs_checkpointing_policy_is_read_from_its_model(policy):
    """Issue 42: the policy a transformers model checkpoints with -- one block in N, or a selective policy function
    asked what it keeps of a run of matmuls -- is the policy the estimate traces."""
    from pilotrun.models.loading import enable_activation_checkpointing

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=4, n_head=2))
    assert enable_activation_checkpointing(model, policy)
    facts = describe_objects(model, None, micro_batch_size=2, max_length=16)
    assert facts.activation_checkpointing is True and facts.checkpointing_policy == policy, facts.checkpointing_source
    spec, provenance = job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
    assert spec.train.activation_checkpointing == (True if policy == "full" else policy)


def test_a_torchtitan_style_policy_function_is_named_and_an_unknown_one_is_said():
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from pilotrun.program.describe import checkpointing_policy

    def titan(meta):   # torchtitan's shape: a count that runs on, every second mm recomputed
        def policy(ctx, func, *args, **kwargs):
            if func == torch.ops.aten.mm.default:
                meta["mm"] += 1
                return CheckpointPolicy.PREFER_RECOMPUTE if meta["mm"] % 2 == 0 else CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return policy

    for fn, expected in ((titan({"mm": 0}), "selective-2"),
                         (lambda ctx, func, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE, "full")):
        model = _gpt2()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, fn)})
        name, why = checkpointing_policy(model)
        assert name == expected, why
    assert "not one pilotrun names" in why


def test_a_described_classification_program_builds_for_the_trace():
    """Issue 44: a BERT classification program's described config carries id2label, and the labels it gives the
    data section were passed again: 'AutoConfig.for_model() got multiple values for keyword argument id2label'
    (exit 2 blaming model.config, which the user never wrote)."""
    from transformers import BertConfig, BertForSequenceClassification

    from pilotrun.models.loading import build_model

    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1}))
    facts = describe_objects(model, torch.optim.AdamW(model.parameters(), lr=1e-4), micro_batch_size=4,
                             max_length=16)
    spec, _ = job_spec({"name": "p", "program": {"command": "python x.py"}}, "x/pilot.yaml", [], facts)
    assert spec.data.task == "seq-classification" and spec.data.labels == ["neg", "pos"]
    built = build_model(spec.model, spec.build_context(), spec.data.labels, meta=True)
    assert built.model.config.id2label == {0: "neg", 1: "pos"} and built.model.config.num_labels == 2
