"""The Trainer integration on TRL's own trainers (real TRL, tiny GPT-2 from a config, the hf-trainer example's
chats): SFTTrainer with its default config (bf16 on: accelerate wraps the forward in autocast, TRL replaces it with
a fused-LM-head forward that closes over the original model) and DPOTrainer, a preference trainer."""
from __future__ import annotations

import copy
import math
import sys

import pytest
import torch

from tests.conftest import EXAMPLES, program_events, program_handle, require

trl = require("trl", "trl")

from accelerate.utils.operations import convert_outputs_to_fp32  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from pilotrun.integrations import transformers as T  # noqa: E402
from pilotrun.integrations.copying import class_forward, own_copy, patched_forwards  # noqa: E402

sys.path.insert(0, str(EXAMPLES / "hf-trainer"))
import chat  # noqa: E402


def _as_trl_prepares(model: torch.nn.Module) -> torch.nn.Module:
    """The forward a TRL SFTTrainer trains with bf16=True on CPU: TRL's fused head, then accelerate's autocast."""
    add_fused_lm_head(model, outputs=("log_probs",))
    func = model.forward.__func__
    model.forward = type(model.forward)(convert_outputs_to_fp32(torch.autocast("cpu", torch.bfloat16)(func)), model)
    return model


def _batch() -> dict:
    return chat.collate(chat.dialogues(4))


def test_a_copy_of_a_trl_patched_model_trains_and_evaluates_the_copy_never_the_original():
    live = _as_trl_prepares(chat.model())
    batch = _batch()
    # The hazard is real in this TRL: copy.deepcopy's forward still reaches the original (its gradients).
    naive = copy.deepcopy(live)
    naive(**batch).loss.backward()
    assert any(p.grad is not None for p in live.parameters()), "TRL no longer closes over the original forward"
    live.zero_grad(set_to_none=True)

    mine = own_copy(live)
    assert patched_forwards(mine) == [""]
    mine(**batch).loss.backward()  # the unfused path (what a compute_loss_func or label smoother calls)
    mine(**batch, fused_lm_head=True).loss.backward()  # and TRL's own
    assert all(p.grad is None for p in live.parameters()), "training the copy put gradients on the live model"
    assert all(p.grad is not None for p in mine.parameters())
    mine.eval()
    with torch.no_grad():
        assert torch.equal(mine(**batch).logits, mine(**batch).logits), "the copy ran the original in train mode"
    assert live.training


def test_class_forward_runs_the_weights_as_a_reload_has_them_and_puts_every_wrapper_and_flag_back():
    live = _as_trl_prepares(chat.model())
    plain = chat.model()  # the same weights (seed 0), no wrapper: what from_pretrained gives a fresh process
    live.transformer.h[0].train(False)  # one module already in eval: its flag must come back as it was
    wrapped = live.forward
    batch = _batch()
    with torch.no_grad():
        want = plain.eval()(**batch).logits
        with class_forward(live) as patched:
            got = live(**batch).logits
            assert not live.training
    assert patched == [""] and torch.equal(got, want)  # not bf16-rounded: the autocast wrapper was set aside
    assert live.forward is wrapped and live.training and not live.transformer.h[0].training


# -- the real trainers, with the callback's probes (reload_eval starts a worker) -----------------------------------

def _pairs(n: int) -> dict[str, list[str]]:
    """The chats as prompt/completion text; the completion starts with a space (TRL joins the two strings, and the
    word-level tokenizer splits on whitespace) and "rejected" gives a wrong number."""
    tok, out = chat.tokenizer(), {"prompt": [], "completion": [], "rejected": []}
    for d in chat.dialogues(n):
        cut = d["labels"].count(-100)
        answer = tok.decode(d["input_ids"][cut:]).split()
        k = next(i for i, w in enumerate(answer) if w.isdigit())
        out["prompt"].append(tok.decode(d["input_ids"][:cut]))
        out["completion"].append(" " + " ".join(answer))
        out["rejected"].append(" " + " ".join(answer[:k] + [str((int(answer[k]) + 7) % 20)] + answer[k + 1:]))
    return out


def _args(tmp_path, config_class, **more):
    return config_class(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, report_to=[],
                        use_cpu=True, save_strategy="no", disable_tqdm=True, per_device_eval_batch_size=4,
                        max_length=64, seed=0, logging_steps=1, **more)


def _gates(job) -> dict[str, dict]:
    return {g["row"]["gate"]: g["row"] for g in program_events(job, "gate")}


@pytest.mark.process
def test_sft_trainer_with_its_default_bf16_passes_every_probe_and_reload_eval(tmp_path):
    from datasets import Dataset

    pairs = _pairs(32)
    data = Dataset.from_dict({"prompt": pairs["prompt"], "completion": pairs["completion"]})
    job = program_handle(tmp_path, "control", stop_at=1)
    args = _args(tmp_path, trl.SFTConfig)
    assert args.bf16, "SFTConfig's default: the case this test is about"
    tr = trl.SFTTrainer(model=chat.model(), args=args, train_dataset=data, eval_dataset=data,
                        processing_class=chat.tokenizer(), callbacks=[T.PilotrunCallback(job)])
    tr.train()
    gates = _gates(job)
    assert {g: gates[g]["verdict"] for g in ("accum_equivalence", "overfit", "export", "reload_eval")} == \
        dict.fromkeys(("accum_equivalence", "overfit", "export", "reload_eval"), "pass"), gates
    reload = gates["reload_eval"]
    assert reload["details"]["max_abs_difference"] == 0.0 and "bf16 autocast" in reload["reason"], reload
    # The probes' 50 overfit updates went through TRL's compute_loss, which counts tokens for its logs: put back.
    assert tr.state.log_history[0]["num_tokens"] < 200, tr.state.log_history[0]


def test_the_probes_put_back_what_a_trainers_compute_loss_counts_for_its_logs():
    from types import SimpleNamespace

    tr = SimpleNamespace(_metrics={"train": {"entropy": [2.5]}}, _total_train_tokens=97,
                         state=SimpleNamespace(num_input_tokens_seen=97))
    with T._bookkeeping_kept(tr):
        tr._metrics["train"]["entropy"].append(0.1)
        tr._total_train_tokens += 3000
        tr.state.num_input_tokens_seen += 3000
    assert tr._metrics == {"train": {"entropy": [2.5]}} and tr._total_train_tokens == 97
    assert tr.state.num_input_tokens_seen == 97


@pytest.mark.process
def test_dpo_trainer_memorises_its_pairs_and_reloads(tmp_path):
    from datasets import Dataset

    pairs = _pairs(32)
    data = Dataset.from_dict({"prompt": pairs["prompt"], "chosen": pairs["completion"], "rejected": pairs["rejected"]})
    job = program_handle(tmp_path, "control", stop_at=1)
    tr = trl.DPOTrainer(model=chat.model(), ref_model=chat.model(), args=_args(tmp_path, trl.DPOConfig),
                        train_dataset=data, eval_dataset=data, processing_class=chat.tokenizer(),
                        callbacks=[T.PilotrunCallback(job)])
    tr.train()
    gates = _gates(job)
    overfit = gates["overfit"]
    assert overfit["verdict"] == "pass", overfit["reason"]
    assert "of the pairs ranked right" in overfit["reason"]
    assert math.isclose(overfit["details"]["thresholds"]["loss_below"], math.log(2) / 2)
    assert gates["reload_eval"]["verdict"] == "pass", gates["reload_eval"]["reason"]
