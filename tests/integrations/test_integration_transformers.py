"""pilotrun.integrations.transformers.PilotrunCallback on a real transformers Trainer (tiny GPT-2 from a config,
synthetic chat from examples/hf-trainer), driven by the real pilotrun.program() handle: its event files are what
the pilot reads."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import EXAMPLES, program_events, program_handle, require

transformers = require("transformers", "transformers")

from pilotrun.gates.accum import check_accum  # noqa: E402
from pilotrun.gates.base import run_check  # noqa: E402
from pilotrun.gates.export import check_export  # noqa: E402
from pilotrun.gates.inspect import check_inspect  # noqa: E402
from pilotrun.gates.reload_eval import reload_after  # noqa: E402
from pilotrun.integrations import common as C  # noqa: E402
from pilotrun.integrations import transformers as T  # noqa: E402
from pilotrun.ledger.records import Verdict  # noqa: E402
from pilotrun.program.handle import ProgramHandle  # noqa: E402

sys.path.insert(0, str(EXAMPLES / "hf-trainer"))
import chat  # noqa: E402

handle, events = program_handle, program_events


def trainer(job, tmp_path: Path, model=None, max_steps: int = 8, probes: bool = False,
            **args) -> transformers.Trainer:
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="linear",
                    save_strategy="no", logging_steps=1, seed=0, report_to=[], dataloader_num_workers=0,
                    use_cpu=True, disable_tqdm=True, per_device_eval_batch_size=8)
    settings.update(args)
    return transformers.Trainer(
        model=model or chat.model(), args=transformers.TrainingArguments(**settings), data_collator=chat.collate,
        processing_class=chat.tokenizer(), train_dataset=chat.ChatData(chat.dialogues(48)),
        eval_dataset=chat.ChatData(chat.dialogues(8, seed=1)), callbacks=[T.PilotrunCallback(job, probes=probes)])


class NoIds(chat.ChatData):
    """The chats without their ``id``: the callback names each update's examples by their dataset positions."""

    def __getitem__(self, i: int) -> dict:
        return {k: v for k, v in self.items[i].items() if k != "id"}


def callback_of(tr) -> T.PilotrunCallback:
    return next(cb for cb in tr.callback_handler.callbacks if isinstance(cb, T.PilotrunCallback))


def test_trainer_reports_every_update_stages_and_saves_and_stops_where_asked(tmp_path):
    job = handle(tmp_path, "control", save_at="3", stop_at=5)
    tr = trainer(job, tmp_path, eval_strategy="steps", eval_steps=2)
    # ids that are not positions: an item's own id is what an update reports
    tr.train_dataset = chat.ChatData([{**it, "id": 1000 + it["id"]} for it in chat.dialogues(48)])
    tr.train()
    assert tr.state.global_step == 5, "the pilot's stop at update 5 is where the Trainer stopped"
    updates = events(job, "update")
    assert [u["update"] for u in updates] == [1, 2, 3, 4, 5]
    assert not events(job, "problem")
    seen: list = []
    for u in updates:
        assert math.isfinite(u["loss"]) and u["lr"] > 0 and u["grad_norm"] > 0
        assert len(u["ids"]) == 8 and all(isinstance(i, int) and i >= 1000 for i in u["ids"])  # 4 × 2, their own ids
        assert "ids_are" not in u["extra"]
        seen += u["ids"]
    assert len(set(seen)) == len(seen) == 40, "within one epoch no example repeats"
    lrs = [u["lr"] for u in updates]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] == pytest.approx(1e-3), "the lr the optimizer stepped with"
    saved = events(job, "saved")
    assert [s["update"] for s in saved] == [3]
    assert Path(saved[0]["path"]).name == "checkpoint-3" and Path(saved[0]["path"]).parent == tmp_path / "control"
    assert (Path(saved[0]["path"]) / "optimizer.pt").is_file()
    stages = {s["row"]["gate"]: s["row"] for s in events(job, "stage")}
    assert set(stages) == {"first_step", "steady_step", "save", "eval"}
    assert all(r["verdict"] == "pass" and r["seconds"] > 0 for r in stages.values())
    assert stages["first_step"]["reason"].startswith("1 update in "), stages["first_step"]["reason"]
    # steady_step spans updates 2-4: the evaluation after update 2 and the save after update 3 are not its time
    steady = stages["steady_step"]
    assert steady["inputs"]["updates"] == 3 and steady["reason"].startswith("3 updates in "), steady["reason"]
    assert [x["what"] for x in steady["details"]["excluded"]] == ["evaluation", "checkpoint save"], steady["details"]
    assert "; evaluation excluded (" in steady["reason"] and "checkpoint save excluded" in steady["reason"]


class IgnoresNumItems(transformers.GPT2LMHeadModel):
    """Takes num_items_in_batch (so the Trainer does not divide by the accumulation steps) but averages its own
    micro batch: transformers#37766's normalisation bug, planted."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = out.logits[:, :-1].flatten(0, 1)
        out.loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        return out


class NoLossKwargs(transformers.GPT2LMHeadModel):
    """No **kwargs at all: the Trainer divides each micro batch's mean by the accumulation steps."""

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize("model_class", [IgnoresNumItems, NoLossKwargs])
def test_accum_equivalence_catches_a_model_whose_loss_ignores_num_items_in_batch(tmp_path, model_class):
    tr = trainer(None, tmp_path, model=chat.model(model_class=model_class))
    result = _accum(tr)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "num_items_in_batch" in result.reason and "#37766" in result.reason
    assert result.details["relative_grad_difference"] > 1e-3
    clean = _accum(trainer(None, tmp_path))
    assert clean.verdict == Verdict.PASS, clean.reason


def _accum(tr):
    """The accumulation gate's own check on the Trainer's view, as the callback runs it."""
    return run_check("accum_equivalence", lambda: check_accum(T.TrainerView(tr, chat.collate)))


class MeanPerMicroBatch(transformers.Trainer):
    """A custom loss in a compute_loss override that averages its own micro batch and ignores num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 label_smoothing=0.1)
        return (loss, out) if return_outputs else loss


def test_accum_equivalence_names_a_compute_loss_override_as_the_place_to_fix(tmp_path):
    tr = trainer(None, tmp_path)
    tr.__class__ = MeanPerMicroBatch  # the helper builds a plain Trainer; the override is all that differs
    result = _accum(tr)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "MeanPerMicroBatch.compute_loss overrides" in result.reason and "forward" not in result.reason


def _differences(want: dict, got: dict) -> list[str]:
    return [f"update {n} {field}" for n in sorted(got) for field in ("ids", "lr", "loss", "grad_norm")
            if got[n][field] != want[n][field]]


def test_the_trainers_own_resume_is_measured_bitwise(tmp_path):
    """What the installed transformers' own resume does, with dropout on and a shuffled sampler, at an epoch
    boundary with save_strategy="epoch" (transformers#17032: the RNG state of an epoch-end checkpoint). Measured on
    transformers 5.24: bitwise equal to the uninterrupted control (mid-epoch, transformers#39215, is measured by the
    hf-trainer example's pilot). ``ignore_data_skip=True`` (replay the epoch from its start) is the planted
    difference that shows the comparison can fail. The chats carry no ``id``: the callback reports the positions the
    Trainer's sampler yielded, which a resume that restores the data order reproduces."""
    data = {"train_dataset": NoIds(chat.dialogues(24))}  # 3 updates per epoch (4 × 2 examples each)

    def run(job, **args):
        tr = trainer(job, tmp_path, max_steps=5, save_strategy="epoch", **args)
        tr.train_dataset = data["train_dataset"]
        tr.train(resume_from_checkpoint=job.resume_from)
        assert "__getitems__" not in vars(tr.train_dataset), "the dataset is left as it was"
        return {u["update"]: u for u in events(job, "update")}, callback_of(tr)

    control, callback = run(handle(tmp_path, "control"))
    assert all(u["extra"] == {"ids_are": "dataset-position"} for u in control.values())
    assert sorted(i for n in (1, 2, 3) for i in control[n]["ids"]) == list(range(24)), "one epoch, shuffled"
    assert [control[n]["ids"] for n in (1, 2, 3)] != [list(range(8 * k, 8 * k + 8)) for k in range(3)]
    inspect = run_check("inspect", lambda: check_inspect(T.TrainerView(callback.trainer, chat.collate,
                                                                       callback.update_ids)))
    assert inspect.verdict == Verdict.PASS and "no 'id': updates name theirs by the positions" in inspect.reason, \
        inspect.reason
    first = handle(tmp_path, "stages", save_at="2,3", stop_at=3)
    run(first)
    saved = {s["update"]: s["path"] for s in events(first, "saved")}
    assert sorted(saved) == [2, 3], "our save at 2, ours and the epoch strategy's at 3"
    found = {}
    # Mid-epoch without ignore_data_skip is the hf-trainer example's own pilot (tests/integrations/test_integration_examples.py:
    # saved after update 3 of 12, SIGKILLed, resumed: bitwise).
    for name, update, args in (("epoch boundary", 3, {}),
                               ("mid-epoch, ignore_data_skip", 2, {"ignore_data_skip": True})):
        got, _ = run(handle(tmp_path / name, "resumed", resume_from=saved[update]), **args)
        assert sorted(got) == list(range(update + 1, 6))
        found[name] = _differences(control, got)
    measured = f"transformers {transformers.__version__}: {found}"
    assert not found["epoch boundary"], measured
    assert found["mid-epoch, ignore_data_skip"][0] == "update 3 ids", measured


def test_outside_a_pilot_the_callback_leaves_the_trainer_alone(tmp_path):
    job = ProgramHandle(environ={})
    assert not job.active
    tr = trainer(job, tmp_path, max_steps=2)
    tr.train()
    assert tr.state.global_step == 2
    assert "training_step" not in vars(tr) and "clip_grad_norm_" not in vars(tr.accelerator), "nothing wrapped"
    assert not (tmp_path / "control").exists()


class MaskingCollator:
    """chat.collate plus random input masking drawn from the collator's own random.Random: state that is in no
    global RNG, so rng_untouched cannot put it back."""

    def __init__(self) -> None:
        import random

        self.rng = random.Random(0)

    def __call__(self, items):
        batch = chat.collate(items)
        masked = torch.tensor([[self.rng.random() < 0.3 for _ in row] for row in batch["input_ids"].tolist()])
        batch["input_ids"] = batch["input_ids"].masked_fill(masked, 1)
        return batch


@pytest.mark.process
def test_the_probes_leave_a_collators_own_random_state_alone_and_skip_accum_on_a_random_collate(tmp_path):
    """The control run (probes on) must draw what the interrupted run (no probes) draws, or the resume gate calls
    the program unseeded; the probes' one-batch-vs-micro-batches comparison means nothing on random masking."""
    first: dict = {}
    for probes in (False, True):
        job = handle(tmp_path / str(probes), "control", stop_at=1)
        tr = trainer(job, tmp_path / str(probes), max_steps=1, probes=probes)
        tr.data_collator = collator = MaskingCollator()
        tr.train()
        first[probes] = (events(job, "update")[0]["loss"], collator.rng.getstate())
    assert first[True] == first[False], "the probes advanced the program's own collator"
    accum = next(g["row"] for g in events(job, "gate") if g["row"]["gate"] == "accum_equivalence")
    assert accum["verdict"] == "skip" and "'input_ids' differs" in accum["reason"], accum


class PlainLM(torch.nn.Module):
    """A Trainer model that is no PreTrainedModel: save_model writes model.safetensors and no config.json."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def test_reload_eval_is_not_measured_for_a_model_from_pretrained_cannot_rebuild(tmp_path):
    tr = trainer(None, tmp_path, model=PlainLM())
    view = T.TrainerView(tr, chat.collate)
    export = run_check("export", lambda: check_export(view, tmp_path / "export"))
    assert export.verdict == Verdict.PASS and "config.json" not in export.details["files"], export.reason
    reload = run_check("reload_eval", lambda: reload_after(view, export, tmp_path / "reload"))
    assert reload.verdict == Verdict.SKIP and "PlainLM is not a transformers PreTrainedModel" in reload.reason


def test_overfit_of_an_adapter_on_a_config_built_base_warns_and_on_a_pretrained_one_fails(tmp_path):
    # A LoRA adapter on a randomly initialised frozen base (what a Trainer pilot without the weights has) cannot
    # memorise: the row warns and says why, not a false failure. The same shortfall on a pretrained base fails.
    import peft
    import transformers

    from pilotrun.gates.overfit import check_overfit

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    items = [{"id": i, "input_ids": row} for i, row in enumerate(ids)]

    def collate(its):
        stacked = torch.stack([it["input_ids"] for it in its])
        return {"input_ids": stacked, "labels": stacked.clone()}

    class ModelView(C.FrameworkView):
        """A framework's view reduced to a model and its own loss (what the overfit check reads)."""

        framework = "a model's own loss"

        def __init__(self, model):
            self._model, self.data = model, C.framework_data(items, items, collate)

        @property
        def model(self):
            return self._model

        def loss(self, m, batch):
            return m(**batch).loss

        def model_copy(self, dtype):
            return self._model, torch.device("cpu")

        # The overfit check reads none of these; a view must still define them (ViewBase checks at definition).
        batching = accum_windows = accumulate = one_batch = normalisation_cause = export = outputs = \
            reload_problem = reload = export_state = None

    def verdict(model):
        torch.manual_seed(0)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        return run_check("overfit", lambda: check_overfit(ModelView(lora)))

    torch.manual_seed(0)
    random_base = transformers.LlamaForCausalLM(cfg)
    random_base.save_pretrained(tmp_path / "base")
    row = verdict(random_base)
    assert row.verdict == Verdict.WARN and "randomly initialised (built from a config)" in row.reason, row.reason
    pretrained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    row = verdict(pretrained)
    assert row.verdict == Verdict.FAIL, row.reason


@pytest.mark.process  # reload_eval starts the reload worker
def test_a_collator_that_returns_a_batch_encoding_is_inspected_and_reloaded(tmp_path):
    # Found by an independent verdict check: transformers' own DataCollatorForLanguageModeling returns a
    # BatchEncoding (a UserDict, not a dict); inspect raised "the collate returned no 'labels' tensor" and reload_eval
    # gave the fresh process no inputs, two false fails on a clean program.
    from pilotrun.gates.inspect import check_inspect

    collator = transformers.DataCollatorForLanguageModeling(chat.tokenizer(), mlm=False)
    items = [{"id": it["id"], "input_ids": it["input_ids"]} for it in chat.dialogues(16)]
    assert not isinstance(collator(items[:2]), dict)
    tr = trainer(None, tmp_path)
    tr.train_dataset = tr.eval_dataset = chat.ChatData(items)
    view = T.TrainerView(tr, collator)
    inspect = run_check("inspect", lambda: check_inspect(view))
    assert inspect.verdict == Verdict.PASS and inspect.details["scan"]["examples"] == 16, inspect.reason
    export = run_check("export", lambda: check_export(view, tmp_path / "export"))
    reload = run_check("reload_eval", lambda: reload_after(view, export, tmp_path / "reload"))
    assert reload.verdict == Verdict.PASS and reload.details["max_abs_difference"] == 0.0, reload.reason


def test_a_reload_that_differs_names_the_export_tensors_that_differ_or_are_missing_before_blaming_weights(tmp_path):
    from pilotrun.gates.reload_eval import _weights_cause, weight_differences
    from pilotrun.gates.view import Artifact

    tr = trainer(None, tmp_path)
    view = T.TrainerView(tr, chat.collate)
    export = run_check("export", lambda: check_export(view, tmp_path / "export"))
    artifact = Artifact(tmp_path / "export", export.details["manifest_sha256"])
    same = weight_differences(view.export_state(), artifact)
    # GPT-2 ties lm_head to the embedding and save_model stores it once: that is not "missing".
    assert same["missing"] == [] and same["differ"] == [] and same["compared"] > 0, same
    out = C.Outcome()
    assert "all" in _weights_cause(view, artifact, out) and "equal the model's" in _weights_cause(view, artifact, out)

    with torch.no_grad():
        tr.model.transformer.h[1].mlp.c_fc.weight.add_(1.0)  # trained on after the export
    tr.model.register_buffer("late_buffer", torch.ones(3))  # state the export never had
    cause = _weights_cause(view, artifact, out)
    assert "transformer.h.1.mlp.c_fc.weight" in cause and "late_buffer" in cause and "missing" in cause, cause
    assert out.details["weights"]["differ"] == ["transformer.h.1.mlp.c_fc.weight"], out.details


def test_under_auto_the_trainers_own_save_steps_save_is_its_own_and_the_run_stops_after_it(tmp_path):
    job = handle(tmp_path, "control", save_auto="3,2")  # pilotrun would ask at 3 too: the Trainer saves there itself
    tr = trainer(job, tmp_path, max_steps=8, save_strategy="steps", save_steps=3, output_dir=str(tmp_path / "ck"))
    tr.train()
    assert [(s["update"], s["asked"]) for s in events(job, "saved")] == [(3, False)]
    assert tr.state.global_step == 5


def test_own_copy_rebinds_defaults_hooks_and_lists_that_reach_the_original_and_class_forward_keeps_device_hooks():
    from pilotrun.integrations.copying import class_forward, own_copy

    live = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    original = live.forward

    def patched(x, _f=original):  # a wrapper holding the original's bound forward as a default
        return _f(x)

    live.forward = patched
    held = [live[0]]
    live[0].register_forward_hook(lambda mod, inp, out: out + 0 * held[0].weight.sum())  # a hook over a list
    mine = own_copy(live)
    mine(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is None for p in live.parameters()), "training the copy put gradients on the live model"
    assert all(p.grad is not None for p in mine.parameters())

    offloaded = torch.nn.Linear(2, 2)
    offloaded._hf_hook = object()  # accelerate's device placement (device_map, CPU offload) is left in place
    placed = offloaded.forward = lambda x: torch.zeros(1)
    with class_forward(offloaded) as patched_names:
        assert patched_names == [] and offloaded.forward is placed
