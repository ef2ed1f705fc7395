"""Pure units of the loop: schedule, data order and position, loss normalisation policy, accumulation."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pilotrun import strategies
from pilotrun.config.schema import build
from pilotrun.config.spec import Spec
from pilotrun.data.bundle import DataBundle
from pilotrun.distributed import DistEnv
from pilotrun.drivers import LoopDriver, NonFiniteError
from pilotrun.models.loading import LoadedModel
from pilotrun.train.loss import decide_loss_policy
from pilotrun.train.optim import Schedule
from pilotrun.train.sampler import DataPlan, PositionedBatchSampler


def test_schedule_shapes():
    cos = Schedule("cosine", warmup=10, total=110, min_ratio=0.1)
    assert cos(0) == pytest.approx(1 / 11)
    assert cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    lin = Schedule("linear", warmup=0, total=100, min_ratio=0.0)
    assert lin(50) == pytest.approx(0.5)
    assert Schedule("constant", 0, 100, 0.0)(77) == 1.0


def test_data_plan_windows_and_partial_last_window():
    plan = DataPlan(n_examples=10, micro_batch_size=3, grad_accum_steps=2, seed=1)
    assert plan.micro_batches_per_epoch == 4  # 3 + 3 + 3 + 1
    assert plan.updates_per_epoch == 2
    assert plan.window_size(0) == 2 and plan.window_size(2) == 2
    dropped = DataPlan(n_examples=10, micro_batch_size=3, grad_accum_steps=2, seed=1, drop_last=True)
    assert dropped.micro_batches_per_epoch == 3 and dropped.window_size(2) == 1  # a short last window
    assert sorted(plan.order(0)) == list(range(10)) and plan.order(0) != plan.order(1)
    assert plan.order(3) == DataPlan(10, 3, 2, seed=1).order(3)  # order is a function of (seed, epoch)


def test_sampler_resumes_from_a_position():
    plan = DataPlan(n_examples=7, micro_batch_size=2, grad_accum_steps=1, seed=5)
    it = iter(PositionedBatchSampler(plan))
    stream = [next(it) for _ in range(12)]  # crosses two epoch boundaries
    resumed = iter(PositionedBatchSampler(plan, epoch=1, micro_index=2))
    assert [next(resumed) for _ in range(6)] == stream[6:12]


class ExplicitItems(nn.Module):
    """Sums token losses and divides by num_items_in_batch, as HF causal LMs do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8, dtype=torch.float64)
        self.head = nn.Linear(8, 20, dtype=torch.float64)

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.view(-1, 20), labels.view(-1), ignore_index=-100, reduction="sum")
        return {"loss": loss / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())}


class MeanPerBatch(ExplicitItems):
    """Averages over its own micro batch and ignores the window: the HF regression of Oct 2024."""

    def forward(self, input_ids, labels):
        return super().forward(input_ids, labels)


class Items(torch.utils.data.Dataset):
    def __init__(self, lengths):
        g = torch.Generator().manual_seed(1)
        self.items = []
        for i, n in enumerate(lengths):
            ids = torch.randint(0, 20, (n,), generator=g).tolist()
            self.items.append({"id": f"e{i}", "ids": ids})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    n = max(len(it["ids"]) for it in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    for r, it in enumerate(items):
        ids[r, : len(it["ids"])] = torch.tensor(it["ids"])
        labels[r, : len(it["ids"])] = torch.tensor(it["ids"])
    return {"input_ids": ids, "labels": labels}


def make_spec(micro, accum, **train):
    return build(Spec, {
        "name": "u", "seed": 0,
        "model": {"factory": "x:y"}, "data": {"factory": "x:y"},
        "train": {"micro_batch_size": micro, "grad_accum_steps": accum, "updates": 10, "shuffle": False,
                  "max_grad_norm": None, "optimizer": {"name": "sgd", "lr": 1.0}, **train},
    })


def Trainer(model, train_set, collate_fn, spec, device) -> LoopDriver:
    """pilotrun's loop on a model and dataset of the test's own, in one process."""
    data = DataBundle(train=train_set, val=train_set, collate=collate_fn)
    return LoopDriver(model, LoadedModel(model, "factory", "custom", "test"), data, None, spec, device, DistEnv(),
                      strategies.get("single"))


def one_update(model_cls, micro, accum, lengths):
    model = model_cls()
    trainer = Trainer(model, Items(lengths), collate, make_spec(micro, accum), torch.device("cpu"))
    rec = trainer.update()
    return rec, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_policy_is_decided_and_explained():
    assert decide_loss_policy(ExplicitItems()).pass_num_items
    policy = decide_loss_policy(MeanPerBatch())
    assert not policy.pass_num_items and "does not declare num_items_in_batch" in policy.reason


def test_accumulation_with_num_items_equals_one_big_batch():
    lengths = [2, 9, 3, 7]  # variable lengths: where per-micro-batch means go wrong
    rec_acc, p_acc = one_update(ExplicitItems, micro=2, accum=2, lengths=lengths)
    rec_one, p_one = one_update(ExplicitItems, micro=4, accum=1, lengths=lengths)
    assert rec_acc.sample_ids == rec_one.sample_ids == ["e0", "e1", "e2", "e3"]
    assert torch.allclose(p_acc, p_one, atol=1e-12, rtol=0)
    assert rec_acc.loss == pytest.approx(rec_one.loss, abs=1e-12)


def test_per_micro_batch_mean_differs_from_one_big_batch():
    lengths = [2, 9, 3, 7]
    _, p_acc = one_update(MeanPerBatch, micro=2, accum=2, lengths=lengths)
    _, p_one = one_update(MeanPerBatch, micro=4, accum=1, lengths=lengths)
    assert not torch.allclose(p_acc, p_one, atol=1e-9)


def test_short_last_window_is_not_scaled_as_if_full():
    # 6 examples, micro 2, accum 2: windows of 2 then 1 micro batch(es).
    model = MeanPerBatch()
    trainer = Trainer(model, Items([4] * 6), collate, make_spec(2, 2), torch.device("cpu"))
    trainer.update()
    batch = collate([Items([4] * 6)[i] for i in (4, 5)])
    with torch.no_grad():
        expected = float(model(**batch)["loss"])  # the model as the last window sees it
    last = trainer.update()
    assert last.micro_batches == 1 and last.sample_ids == ["e4", "e5"]
    assert last.loss == pytest.approx(expected, rel=1e-12)  # divided by 1 micro batch, not by 2


def test_non_finite_loss_names_update_and_examples():
    class Inf(ExplicitItems):
        def forward(self, input_ids, labels, num_items_in_batch=None):
            return {"loss": super().forward(input_ids, labels, num_items_in_batch)["loss"] * math.inf}

    trainer = Trainer(Inf(), Items([3] * 4), collate, make_spec(2, 1), torch.device("cpu"))
    with pytest.raises(NonFiniteError) as info:
        trainer.update()
    assert info.value.step == 1 and info.value.ids == ["e0", "e1"]
    assert "loss is inf at update 1; examples in that update: e0, e1" in str(info.value)


def test_position_round_trips():
    model = ExplicitItems()
    trainer = Trainer(model, Items([3] * 9), collate, make_spec(2, 2), torch.device("cpu"))
    trainer.update()
    trainer.update()
    state = trainer.state()
    expected = trainer.update().sample_ids
    other = Trainer(ExplicitItems(), Items([3] * 9), collate, make_spec(2, 2), torch.device("cpu"))
    other.load_state(state)
    assert other.update().sample_ids == expected
    assert state["data_position"]["epoch"] == 0 and state["data_position"]["micro_index"] == 4  # 5 micro batches per epoch


def test_transformers_is_quieted_once_imported_and_put_back_after():
    import logging

    from transformers.utils import logging as hf_logging

    from pilotrun.models.quiet import QuietTransformers

    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    with QuietTransformers() as quiet:
        assert hf_logging.get_verbosity() == logging.ERROR and not hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_info()  # what a model's code may do; settle() quiets only once per pilot
        quiet.settle()
        assert hf_logging.get_verbosity() == logging.INFO
    assert hf_logging.get_verbosity() == logging.WARNING and hf_logging.is_progress_bar_enabled()


def test_quieting_transformers_waits_for_its_import(monkeypatch):
    import logging
    import sys

    from transformers.utils import logging as hf

    from pilotrun.models.quiet import QuietTransformers

    hf.set_verbosity_warning()
    monkeypatch.delitem(sys.modules, "transformers.utils.logging")  # a job that has not imported transformers
    with QuietTransformers() as quiet:
        assert "transformers.utils.logging" not in sys.modules  # entering imported nothing
        assert hf.get_verbosity() == logging.WARNING
        monkeypatch.setitem(sys.modules, "transformers.utils.logging", hf)  # as a load gate's import would
        quiet.settle()
        assert hf.get_verbosity() == logging.ERROR
    assert hf.get_verbosity() == logging.WARNING
