"""pilotrun.integrations.lightning.PilotrunCallback on a real Lightning Trainer (examples/lightning), driven by the
real pilotrun.program() handle: its event files are what the pilot reads."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import EXAMPLES, REPO, program_events, program_handle, require

L = require("lightning.pytorch", "lightning")

from pilotrun.gates.accum import check_accum  # noqa: E402
from pilotrun.gates.base import run_check  # noqa: E402
from pilotrun.gates.batch import check_batch  # noqa: E402
from pilotrun.gates.inspect import check_inspect  # noqa: E402
from pilotrun.gates.overfit import check_overfit  # noqa: E402
from pilotrun.integrations import lightning as PL  # noqa: E402
from pilotrun.ledger.records import Verdict  # noqa: E402

sys.path.insert(0, str(EXAMPLES / "lightning"))
import points  # noqa: E402

handle, events = program_handle, program_events


class NoIds(points.Points):
    """Points whose items carry no ``id``: the callback names each update's examples by their dataset positions."""

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        del item["id"]
        return item


def no_ids_loader(n: int, seed: int = 0, shuffle: bool = True) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(NoIds(n, seed), batch_size=4, num_workers=0,
                                       sampler=points.EpochSeededSampler(n, seed) if shuffle else None)


def fit(job, tmp_path: Path, max_steps: int = 6, n: int = 48, probes: bool = False, loader=points.loader,
        **kw) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / "out"), callbacks=[PL.PilotrunCallback(job, probes=probes)],
                        **kw)
    trainer.fit(points.Regressor(), loader(n), loader(8, seed=1, shuffle=False), ckpt_path=job.resume_from)
    return trainer


def test_lightning_reports_every_update_stages_and_saves_and_stops_where_asked(tmp_path):
    job = handle(tmp_path, "control", save_at="3", stop_at=5)
    trainer = fit(job, tmp_path, max_steps=8, val_check_interval=4, limit_val_batches=1)  # validation every 2
    assert trainer.global_step == 5
    updates = events(job, "update")
    assert [u["update"] for u in updates] == [1, 2, 3, 4, 5] and not events(job, "problem")
    ids = [i for u in updates for i in u["ids"]]
    assert all(len(u["ids"]) == 8 for u in updates) and len(set(ids)) == 40
    assert all(math.isfinite(u["loss"]) and u["grad_norm"] > 0 for u in updates)
    assert [u["lr"] for u in updates] == pytest.approx([1e-2 / (1 + k) for k in range(5)]), "lr stepped with"
    saved = events(job, "saved")
    assert [(s["update"], Path(s["path"]).name) for s in saved] == [(3, "step-3.ckpt")]
    stages = {s["row"]["gate"]: s["row"] for s in events(job, "stage")}
    assert set(stages) == {"first_step", "steady_step", "save", "eval"}
    assert all(r["verdict"] == "pass" for r in stages.values())
    assert stages["first_step"]["reason"].startswith("1 update in "), stages["first_step"]["reason"]
    # steady_step spans updates 2-4: the validation after update 2 and the save after update 3 are not its time
    steady = stages["steady_step"]
    assert steady["inputs"]["updates"] == 3 and steady["reason"].startswith("3 updates in "), steady["reason"]
    assert "per update" in steady["reason"] and "; validation excluded (" in steady["reason"], steady["reason"]
    assert "checkpoint save excluded" in steady["reason"], steady["reason"]
    assert [x["what"] for x in steady["details"]["excluded"]] == ["validation", "checkpoint save"]


class TokenMean(L.LightningModule):
    """A tiny LM whose loss is the mean over each batch's own tokens: with variable lengths, accumulating micro
    batches weighs tokens differently than one batch (Lightning passes no num_items_in_batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        logits = self.out(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _token_items(n: int) -> list[dict]:
    return [{"id": i, "tokens": [(i * 7 + j) % 16 for j in range(2 + (i * 5) % 9)]} for i in range(n)]


def _pad(items: list[dict]) -> dict:
    width = max(len(it["tokens"]) for it in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100)
    for row, it in enumerate(items):
        ids[row, :len(it["tokens"])] = torch.tensor(it["tokens"])
        labels[row, :len(it["tokens"])] = torch.tensor(it["tokens"])
    return {"id": [it["id"] for it in items], "input_ids": ids, "labels": labels}


def _check(check, fake, module):
    """A gate's own check on the Lightning view of a fit (a stand-in trainer: what the view reads of one)."""
    return run_check("probe", lambda: check(PL.LightningView(fake, module)))


def test_accum_equivalence_catches_a_per_batch_token_mean_and_passes_a_fixed_size_loss():
    loader = torch.utils.data.DataLoader(_token_items(16), batch_size=2, collate_fn=_pad)
    bad = _check(check_accum, SimpleNamespace(train_dataloader=loader, accumulate_grad_batches=2, world_size=1),
                 TokenMean())
    assert bad.verdict == Verdict.FAIL and "averaged per micro batch" in bad.reason, bad.reason
    # Lightning's own remedy, not the Trainer's (a LightningModule has no num_items_in_batch or compute_loss_func)
    assert "accumulate_grad_batches" in bad.reason and "num_items_in_batch" not in bad.reason, bad.reason
    assert len(set(bad.details["windows"][0]["supervised_per_micro_batch"])) > 1
    clean = _check(check_accum, SimpleNamespace(train_dataloader=points.loader(16), accumulate_grad_batches=2,
                                                world_size=1), points.Regressor(dropout=0.5))
    assert clean.verdict == Verdict.PASS, clean.reason
    assert clean.reason.startswith("2 micro batches of the first 8 examples (4+4 examples)"), clean.reason
    # A program that does not accumulate is still compared as if it did, and the row says so (found with
    # accumulate_grad_batches=1: "2 micro batches (20+20)" with nothing saying the program takes one per update).
    single = _check(check_accum, SimpleNamespace(train_dataloader=points.loader(16), accumulate_grad_batches=1,
                                                 world_size=1), points.Regressor(dropout=0.5))
    assert single.verdict == Verdict.PASS and single.reason.startswith(
        "the program does not accumulate (accumulate_grad_batches 1); compared as if it did: the first 8 examples "
        "as one batch vs as 2 micro batches (4+4) accumulated: relative gradient difference "), single.reason
    assert single.details["program_accumulates"] is False


class MaskingPad:
    """_pad plus random input masking from the collate's own random.Random (state no global RNG holds)."""

    def __init__(self) -> None:
        import random

        self.rng = random.Random(0)

    def __call__(self, items):
        batch = _pad(items)
        keep = torch.tensor([[self.rng.random() >= 0.3 for _ in row] for row in batch["input_ids"].tolist()])
        batch["input_ids"] = batch["input_ids"] * keep
        return batch


def test_the_probes_leave_the_collates_own_state_alone_and_skip_accum_on_a_random_collate():
    collate = MaskingPad()
    state = collate.rng.getstate()
    loader = torch.utils.data.DataLoader(_token_items(16), batch_size=2, collate_fn=collate)
    fake = SimpleNamespace(train_dataloader=loader, accumulate_grad_batches=2, world_size=1)
    result = _check(check_accum, fake, TokenMean())
    assert result.verdict == Verdict.SKIP and "'input_ids' differs" in result.reason, result.reason
    for check in (check_inspect, check_overfit):
        _check(check, fake, TokenMean())
    assert collate.rng.getstate() == state, "the probes advanced the program's own collate"


class ReadsItsTrainer(points.Regressor):
    """A clean module whose training_step reads its trainer (the lr it logs, the accumulation it scales by)."""

    def training_step(self, batch, batch_idx):
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx) * (self.trainer.accumulate_grad_batches / 2)


def test_a_training_step_that_reads_its_trainer_is_probed_not_failed(tmp_path):
    # Found piloting a clean script that logs self.lr_schedulers().get_last_lr() in training_step: accum_equivalence,
    # overfit and reload_eval all failed with "SeqClassifier is not attached to a `Trainer`".
    job = handle(tmp_path, "control", stop_at=1)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=1, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / "out"), callbacks=[PL.PilotrunCallback(job)])
    trainer.fit(ReadsItsTrainer(), no_ids_loader(16))
    rows = {g["row"]["gate"]: g["row"] for g in events(job, "gate")}
    # The items carry no id: inspect says what names the updates' examples instead (what the resume row compares).
    inspect = rows["inspect"]
    assert inspect["verdict"] == "pass" and "(dataset positions 0, 1, 2, 3; the items have no 'id')" in \
        inspect["reason"], inspect["reason"]
    assert events(job, "update")[0]["extra"] == {"ids_are": "dataset-position"}
    assert rows["accum_equivalence"]["verdict"] == "pass", rows["accum_equivalence"]["reason"]
    assert rows["overfit"]["verdict"] == "pass", rows["overfit"]["reason"]
    reload = rows["reload_eval"]
    assert reload["verdict"] == "skip" and "fails without its Trainer" in reload["reason"], reload["reason"]


def test_the_batch_row_reads_a_dataloader_built_with_a_batch_sampler():
    data = points.Points(48)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 4, drop_last=False)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    row = _check(check_batch, SimpleNamespace(train_dataloader=loader, accumulate_grad_batches=2, world_size=1),
                 points.Regressor())
    assert row.reason.startswith("4 x 2 x 1 replica(s) = 8 examples per update; 48 examples -> 6 updates per "
                                 "epoch"), row.reason


def test_lightnings_own_resume_is_measured_bitwise(tmp_path):
    """Lightning's ckpt_path resume, with dropout on and a shuffled loader (examples/lightning: RNG state kept by the
    module's checkpoint hooks, a sampler seeded by (seed, epoch)), 3 updates per epoch. Measured on Lightning 2.6:
    at an epoch boundary the resumed updates equal the control's bitwise; mid-epoch a plain DataLoader is not
    resumable and Lightning replays the epoch from its start (its own warning says so), so the first resumed
    update sees other examples. The items carry no ``id``: the callback reports the dataset positions the sampler
    yielded (a validation loop between updates fetches too, and is not counted)."""
    def run(job):
        fit(job, tmp_path, max_steps=5, n=24, loader=no_ids_loader, val_check_interval=2, limit_val_batches=1)
        return {u["update"]: u for u in events(job, "update")}

    control = run(handle(tmp_path, "control"))
    assert all(u["extra"] == {"ids_are": "dataset-position"} for u in control.values())
    assert sorted(i for n in (1, 2, 3) for i in control[n]["ids"]) == list(range(24)), "one epoch, shuffled"
    first = handle(tmp_path, "stages", save_at="2,3", stop_at=3)
    run(first)
    saved = {s["update"]: s["path"] for s in events(first, "saved")}
    found = {}
    for update in (2, 3):
        got = run(handle(tmp_path / str(update), "resumed", resume_from=saved[update]))
        assert sorted(got) == list(range(update + 1, 6))
        found[update] = [f"update {n} {f}" for n in sorted(got) for f in ("ids", "lr", "loss", "grad_norm")
                         if got[n][f] != control[n][f]]
    assert found[3] == [], f"epoch boundary: {found[3]}"
    assert found[2][0] == "update 3 ids", f"mid-epoch: {found[2]}"


@pytest.mark.process
def test_importing_pilotrun_does_not_import_lightning_and_a_missing_extra_says_how_to_install():
    code = ("import sys, pilotrun, pilotrun.integrations; "
            "assert 'lightning' not in sys.modules, 'lightning imported'; "
            "sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
            "try:\n    import pilotrun.integrations.lightning\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install 'pilotrun[lightning]'" in out.stdout


class SqueezesItsBatch(L.LightningModule):
    """A binary classifier whose training_step squeezes its logits: on a batch of one the batch dimension goes too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(points.DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        target = (batch["y"] > 0).float()
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]).squeeze(), target)


def test_overfit_scores_as_one_batch_a_loss_that_cannot_take_one_example():
    # Found by an independent verdict check: scoring each example alone raised "Target size ([1]) must be the same as
    # input size ([])" in the user's own training_step, a false fail; the subset is scored as one batch and the row
    # says so.
    fake = SimpleNamespace(train_dataloader=points.loader(16), accumulate_grad_batches=2, world_size=1)
    row = _check(check_overfit, fake, SqueezesItsBatch())
    assert row.verdict == Verdict.PASS, row.reason
    assert row.details["scored"].startswith("as one batch: the loss fails on a batch of one example (ValueError")
    assert "scored as one batch" in row.reason
    clean = _check(check_overfit, fake, points.Regressor(dropout=0.0))
    assert clean.verdict == Verdict.PASS and "scored" not in clean.details, clean.reason


def test_the_fits_own_model_checkpoint_saves_are_reported_so_auto_proves_them_and_stops_after(tmp_path):
    # pilot.resume.before: auto: the control run asks for no save; the first one it reports is the program's own
    # (a ModelCheckpoint every 4 updates) and the run stops `after` (2) updates later.
    job = handle(tmp_path, "control", save_auto="50,2")
    L.seed_everything(0, verbose=False)
    own = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(max_steps=12, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "out"),
                        limit_val_batches=0, callbacks=[PL.PilotrunCallback(job, probes=False), own])
    trainer.fit(points.Regressor(), points.loader(96))
    saved = events(job, "saved")
    assert [(s["update"], s["asked"]) for s in saved] == [(4, False)], saved
    assert Path(saved[0]["path"]).is_file() and Path(saved[0]["path"]).parent == tmp_path / "ck"
    assert trainer.global_step == 6  # stopped 2 updates after the program's own checkpoint
