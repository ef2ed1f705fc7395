"""accum_equivalence's diagnosis and verdict (issue 44, 2): an exact xk scale is the loss normalisation, never 'examples
influence each other'; a program that does not accumulate gets a latent defect as a warning, not a failure. Pure
tests of the diagnosis, and a real transformers Trainer over a tiny BERT classifier whose loss ignores the
num_items_in_batch the Trainer gives it (the run_classification.py finding)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pilotrun.gates.accum import (
    Diagnosis,
    WindowResult,
    check_accum,
    diagnose_difference,
    exact_scale,
    judge,
)
from pilotrun.gates.base import GateFailure, Outcome, run_check
from pilotrun.gates.view import WindowKind
from pilotrun.ledger.records import Verdict
from tests.conftest import require

transformers = require("transformers", "transformers")


def _result(scale: float | None, counts=(3, 3), rel: float = 0.5) -> WindowResult:
    return WindowResult(window="2 micro batches of the first 8 examples", kind=str(WindowKind.SAMPLE),
                        micro_batches=2, examples=8, relative_grad_difference=rel, relative_loss_difference=rel,
                        accumulated_loss=2.0, one_batch_loss=1.0, micro_batch_sizes=[4, 4],
                        supervised_per_micro_batch=list(counts), gradient_scale=scale)


def _view(normalisation: str | None = None, **extra):
    return SimpleNamespace(normalisation_cause=lambda counts, sizes: normalisation, **extra)


def test_an_exact_factor_is_found_and_a_different_direction_is_not():
    g = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert exact_scale(2 * g, g, 1e-5) == pytest.approx(2.0)
    assert exact_scale(0.5 * g, g, 1e-5) == pytest.approx(0.5)
    assert exact_scale(g, g, 1e-5) is None                      # equal: nothing to explain
    other = g.clone()
    other[:10] *= -1                                            # another direction, not a factor
    assert exact_scale(2 * other, g, 1e-5) is None
    assert exact_scale(g, torch.zeros_like(g), 1e-5) is None


def test_an_exact_scale_is_named_as_the_normalisation_not_batch_dependence():
    d = diagnose_difference(_view(), _result(2.0))
    assert d["kind"] == Diagnosis.SCALE and d["scale"] == 2.0
    assert "exactly 2x" in d["cause"] and "normalisation" in d["cause"] and "influence" not in d["cause"], d
    assert "without dividing by their count" in d["cause"], d["cause"]
    halved = diagnose_difference(_view(), _result(0.5))
    assert halved["kind"] == Diagnosis.SCALE and "twice" in halved["cause"], halved
    # A view that names its own framework's cause is asked first.
    own = diagnose_difference(_view(scale_cause=lambda k, n: f"the framework's words for {k:g} over {n}"),
                              _result(2.0))
    assert own["cause"] == "the framework's words for 2 over 2"
    # Without a factor: the per-micro-batch mean where the counts differ, else batch dependence.
    assert diagnose_difference(_view("mean per micro batch"), _result(None, (2, 5)))["kind"] == Diagnosis.NORMALISATION
    rest = diagnose_difference(_view(), _result(None))
    assert rest["kind"] == Diagnosis.BATCH_DEPENDENCE and "influence each other" in rest["cause"]


def test_a_mismatch_as_if_accumulating_warns_as_latent_and_fails_where_the_program_accumulates():
    results, diagnosis = [_result(2.0)], diagnose_difference(_view(), _result(2.0))
    out = judge(Outcome(details={"dtype": "float64"}), results, diagnosis, 1e-5, "cpu", declared=False,
                as_if="gradient_accumulation_steps 1")
    assert out.verdict == Verdict.WARN, out.reason
    assert out.reason.startswith("latent accumulation defect, not this run's failure: the program does not "
                                 "accumulate (gradient_accumulation_steps 1)"), out.reason
    assert "exactly 2x" in out.reason and out.details["latent"] is True
    assert out.details["diagnosis"]["kind"] == "scale"
    with pytest.raises(GateFailure) as err:
        judge(Outcome(details={"dtype": "float64"}), results, diagnosis, 1e-5, "cpu", declared=False)
    assert "exactly 2x" in err.value.reason and "latent" not in err.value.reason


class Pairs(torch.utils.data.Dataset):
    """Sentences of varying length with one class label each (every micro batch holds as many labels)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [{"id": i, "input_ids": torch.randint(1, 64, (4 + i % 5,), generator=g).tolist(),
                       "labels": i % 2} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate(items: list[dict]) -> dict:
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, it in enumerate(items):
        ids[row, :len(it["input_ids"])] = torch.tensor(it["input_ids"])
        mask[row, :len(it["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([it["labels"] for it in items])}


def _bert_trainer(tmp_path: Path, accumulation: int, opt_out: bool = False):
    from pilotrun.integrations import transformers as T

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64))
    if opt_out:
        model.accepts_loss_kwargs = False  # the fix the reason names
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, data_collator=collate, train_dataset=Pairs(16),
                                   eval_dataset=Pairs(4))
    return run_check("accum_equivalence", lambda: check_accum(T.TrainerView(trainer, collate)))


def test_a_trainer_classifier_ignoring_num_items_in_batch_is_a_latent_warning_at_accumulation_1(tmp_path):
    """run_classification.py (issue 44): BERT's classification loss takes **kwargs, so the Trainer leaves the division
    to it, but it averages its own micro batch: exactly 2.0x at accumulation 2. At accumulation 1 the run is not
    affected: a warning naming the normalisation and its fix, not 'labels from a neighbour'."""
    single = _bert_trainer(tmp_path, 1)
    assert single.verdict == Verdict.WARN, single.reason
    assert single.reason.startswith("latent accumulation defect, not this run's failure: the program does not "
                                    "accumulate (gradient_accumulation_steps 1)"), single.reason
    assert "exactly 2x the one-batch gradient: the loss normalisation" in single.reason, single.reason
    assert "accepts_loss_kwargs = False" in single.reason and "num_items_in_batch" in single.reason
    assert "neighbour" not in single.reason and "influence" not in single.reason
    assert single.details["windows"][0]["gradient_scale"] == pytest.approx(2.0, rel=1e-6)
    assert single.details["program_accumulates"] is False and single.details["latent"] is True
    accumulating = _bert_trainer(tmp_path, 2)
    assert accumulating.verdict == Verdict.FAIL, accumulating.reason
    assert "exactly 2x" in accumulating.reason and "latent" not in accumulating.reason
    fixed = _bert_trainer(tmp_path, 2, opt_out=True)
    assert fixed.verdict == Verdict.PASS, fixed.reason
