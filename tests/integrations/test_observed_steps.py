"""The optimizer steps a hand-written loop really takes (issue 44, item 1): accelerate's and Fabric's loops are
watched while they run, and the batch and accum_equivalence rows are built from what the loop did — a first step
after one micro batch at half its loss, or losses added without dividing, fail with their cause whatever the
framework's setting says; a loop that accumulates correctly passes with the factors it applied."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from pilotrun.gates.view import UpdateIds
from pilotrun.integrations.accelerate import AccelerateView
from pilotrun.integrations.observe import StepObserver, merge, split


class Job:
    """The handle as the watcher uses it: rows recorded by gate name."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str, dict]] = {}

    def record_gate(self, gate, verdict, reason, **details) -> None:
        self.rows[str(gate)] = (str(verdict), reason, details)


def _items(n: int = 48, lengths: tuple[int, ...] = (6,)) -> list[dict]:
    return [{"input_ids": list(range(3, 3 + lengths[i % len(lengths)])),
             "labels": list(range(3, 3 + lengths[i % len(lengths)]))} for i in range(n)]


def _collate(batch: list[dict]) -> dict:
    width = max(len(it["input_ids"]) for it in batch)
    pad = [width - len(it["input_ids"]) for it in batch]
    return {"input_ids": torch.tensor([it["input_ids"] + [0] * p for it, p in zip(batch, pad, strict=True)]),
            "attention_mask": torch.tensor([[1] * len(it["input_ids"]) + [0] * p
                                            for it, p in zip(batch, pad, strict=True)]),
            "labels": torch.tensor([it["labels"] + [-100] * p for it, p in zip(batch, pad, strict=True)])}


def _accelerate(setting: int = 1, lengths: tuple[int, ...] = (6,)):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=setting)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=1, eos_token_id=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_items(lengths=lengths), batch_size=4,  # type: ignore[arg-type]
                                         collate_fn=_collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    job = Job()
    view = AccelerateView(accelerator, model, loader, None, 8, None, UpdateIds(False, "not read"))
    observer = StepObserver(job, view, loader, opt, lambda: None)
    return accelerator, model, opt, loader, job, observer


def _hand_loop(accelerator, model, opt, loader, accum: int, first_step_at_zero: bool, divide: bool) -> None:
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        accelerator.backward(loss / accum if divide else loss)
        if (step % accum == 0) if first_step_at_zero else ((step + 1) % accum == 0):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if step >= 8:
            break


@pytest.fixture(autouse=True)
def _backward_restored():
    from accelerate.state import AcceleratorState, GradientState

    before = torch.autograd.backward
    yield
    # accelerate keeps its state in process-wide singletons (a loop left mid-window would leave the next
    # test's optimizer never stepping).
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert torch.autograd.backward is before, "the watcher left torch.autograd.backward patched"


def test_a_hand_window_that_steps_after_its_first_micro_batch_fails_with_the_off_by_one():
    accelerator, model, opt, loader, job, observer = _accelerate()
    cls = type(loader)
    _hand_loop(accelerator, model, opt, loader, accum=2, first_step_at_zero=True, divide=True)
    # Three steps seen: every hook is gone and the loader's class is as it was.
    assert vars(cls)["__iter__"].__qualname__ == "DataLoaderShard.__iter__"
    assert not model._forward_pre_hooks and observer._undo == [] and not observer.pending
    assert not opt.optimizer._optimizer_step_pre_hooks
    verdict, reason, details = job.rows["accum_equivalence"]
    assert verdict == "fail", reason
    assert details["diagnosis"]["kind"] == "scale" and details["diagnosis"]["scale"] == pytest.approx(0.5)
    assert "off-by-one" in reason and "after 1 micro batch" in reason
    verdict, reason, details = job.rows["batch"]
    assert verdict == "warn" and "(1/2/2 micro batches)" in reason and "off by one at the start" in reason
    assert details["observed"]["examples_per_update"] == [4, 8, 8]
    assert "4 x 2 x 1 replica(s) = 8 examples per update" in reason  # what the loop does, not the setting's 1


def test_losses_added_without_dividing_fail_as_the_normalisation():
    accelerator, model, opt, loader, job, _ = _accelerate()
    _hand_loop(accelerator, model, opt, loader, accum=2, first_step_at_zero=False, divide=False)
    verdict, reason, details = job.rows["accum_equivalence"]
    assert verdict == "fail" and details["diagnosis"]["scale"] == pytest.approx(2.0), reason
    assert "without dividing" in reason and "off-by-one" not in reason


def test_accelerates_own_accumulation_passes_with_the_factors_it_applied():
    accelerator, model, opt, loader, job, _ = _accelerate(setting=2)
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            opt.step()  # accelerate steps the torch optimizer only at the window's end
            opt.zero_grad()
        if step >= 8:
            break
    verdict, reason, details = job.rows["accum_equivalence"]
    assert verdict == "pass", reason
    assert details["observed"]["first_window_loss_factors"] == [pytest.approx(0.5), pytest.approx(0.5)]
    verdict, reason, details = job.rows["batch"]
    assert verdict == "pass" and "(2/2/2 micro batches)" in reason, reason
    assert details["setting"] == {"gradient_accumulation_steps": 2}


def test_a_loop_that_does_not_accumulate_is_compared_as_if_it_did_and_says_what_was_observed():
    accelerator, model, opt, loader, job, _ = _accelerate(lengths=(4, 9))
    _hand_loop(accelerator, model, opt, loader, accum=1, first_step_at_zero=False, divide=False)
    verdict, reason, _ = job.rows["accum_equivalence"]
    # One micro batch per step at factor 1: nothing of the loop's own to compare; the setting's check (as if it
    # accumulated) finds accelerate's mean-of-means over different lengths, a latent defect.
    assert reason.startswith("observed: its first update was one micro batch with its loss unscaled"), reason
    assert verdict == "warn" and "latent accumulation defect" in reason
    assert "(1/1/1 micro batches)" in job.rows["batch"][1]


def test_a_window_regrouped_as_examples_pads_to_the_longest():
    a = _collate(_items(2, (3,)))
    b = _collate(_items(2, (5,)))
    parts = split(a, 2) + split(b, 2)
    assert [p["input_ids"].shape for p in parts] == [torch.Size([1, 3])] * 2 + [torch.Size([1, 5])] * 2
    big: Any = merge(parts)
    assert big["input_ids"].shape == (4, 5) and big["labels"][0, 3:].tolist() == [-100, -100]
    assert big["attention_mask"][:2].sum() == 6 and big["attention_mask"][2:].sum() == 10
