"""The strategy owns the training step: backward, gradient clipping, the optimizer step and the build context.

The defaults are the loop's former inline code, so the numbers must be exactly the old ones; and the loop
must really call the strategy's methods (a strategy of the test's own, put in the registry, proves it).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from pilotrun import strategies
from pilotrun.config import load_spec
from pilotrun.drivers import build_job
from pilotrun.strategies.single import Single
from tests.conftest import gate_rows


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _loss(model: nn.Module, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g) * scale, torch.randint(0, 3, (8,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _old_inline_update(model, opt, scaler, max_norm):
    """drivers/loop.py before the strategy owned the step (train/loss.py's backward, _clip, _step), verbatim."""
    loss = _loss(model, 50.0)
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if scaler is not None:
        scaler.unscale_(opt)
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm is not None else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    skipped = False
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < before
    else:
        opt.step()
    return norm, skipped


def _strategy_update(strategy, model, opt, scaler, max_norm):
    strategy.backward(_loss(model, 50.0), scaler)
    norm = strategy.clip_gradients(model.parameters(), max_norm, opt, scaler)
    return norm, strategy.optimizer_step(opt, scaler)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
@pytest.mark.parametrize("max_norm", [0.5, None], ids=["clipped", "measured"])
def test_the_default_step_gives_the_old_inline_numbers(fp16, max_norm):
    old, new = _model(), _model()
    opt_old, opt_new = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (old, new))
    scaler_old, scaler_new = ((torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")) if fp16 else (None, None))
    for _ in range(3):  # AdamW state and the scaler's growth tracker both carry over
        expected = _old_inline_update(old, opt_old, scaler_old, max_norm)
        got = _strategy_update(strategies.get("single"), new, opt_new, scaler_new, max_norm)
        assert got == expected
        assert isinstance(got[0], float) and got[0] > (max_norm or 0)  # the norm before clipping
        for a, b in zip(old.parameters(), new.parameters()):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    if fp16:
        assert scaler_new.state_dict() == scaler_old.state_dict()


def test_the_fp16_scaler_skips_a_non_finite_update_and_says_so():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = copy.deepcopy(model.state_dict())
    single = strategies.get("single")
    single.backward(_loss(model) * float("inf"), scaler)
    norm = single.clip_gradients(model.parameters(), 1.0, opt, scaler)
    assert norm is not None and not torch.isfinite(torch.tensor(norm))
    assert single.optimizer_step(opt, scaler) is True and scaler.get_scale() == 65536.0 / 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # without a scaler the step is taken (the caller refuses a non-finite norm first) and nothing is skipped
    opt.zero_grad(set_to_none=True)
    single.backward(_loss(model))
    assert single.optimizer_step(opt, None) is False
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_clipping_without_a_gradient_is_none_and_unscaling_needs_the_optimizer():
    model = _model()
    single = strategies.get("single")
    assert single.clip_gradients(model.parameters(), 1.0) is None
    with pytest.raises(ValueError, match="needs the optimizer"):
        single.clip_gradients(model.parameters(), 1.0, None, torch.amp.GradScaler("cpu"))
    assert single.init_context(torch.device("cpu")).__enter__() is None


class Recording(Single):
    """A strategy of the test's own: every step method records its call and answers what the loop must report."""

    def __init__(self):
        self.calls: list[str] = []

    @contextlib.contextmanager
    def _building(self):
        self.calls.append("init_context")
        yield
        self.calls.append("built")

    def init_context(self, device):
        return self._building()

    def backward(self, loss, scaler=None):
        self.calls.append("backward")
        super().backward(loss, scaler)

    def clip_gradients(self, params, max_norm, optimizer=None, scaler=None):
        self.calls.append("clip_gradients")
        super().clip_gradients(params, max_norm, optimizer, scaler)
        return 123.25

    def optimizer_step(self, optimizer, scaler=None):
        self.calls.append("optimizer_step")
        return True  # and no step: the weights must not move


# The recording strategy takes no optimizer step, so torch warns that the scheduler stepped first.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_the_loop_driver_runs_the_registered_strategy_s_step(toy, monkeypatch):
    recording = Recording()
    monkeypatch.setitem(strategies.STRATEGIES, "single", recording)
    spec = load_spec(toy)
    driver = build_job(spec)
    try:
        assert driver.strategy is recording and recording.calls[:2] == ["init_context", "built"]
        if "backward" in recording.calls:  # the loss-policy probe runs no backward; nothing else may either
            pytest.fail(f"backward before the first update: {recording.calls}")
        before = [p.detach().clone() for p in driver.model.parameters()]
        recording.calls.clear()
        record = driver.update()
        accum = spec.train.grad_accum_steps
        assert recording.calls == ["backward"] * accum + ["clip_gradients", "optimizer_step"]
        assert record.grad_norm == 123.25 and record.scaler_skipped is True
        assert all(torch.equal(a, b) for a, b in zip(before, driver.model.parameters()))
    finally:
        driver.close()


class Counting(Single):
    """The one-process strategy as it is, counting its step methods' calls."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def backward(self, loss, scaler=None):
        self._count("backward")
        super().backward(loss, scaler)

    def clip_gradients(self, params, max_norm, optimizer=None, scaler=None):
        self._count("clip_gradients")
        return super().clip_gradients(params, max_norm, optimizer, scaler)

    def optimizer_step(self, optimizer, scaler=None):
        self._count("optimizer_step")
        return super().optimizer_step(optimizer, scaler)


def test_the_overfit_gate_steps_its_copy_with_the_one_process_strategy(toylm, tmp_path, monkeypatch):
    counting = Counting()
    monkeypatch.setitem(strategies.STRATEGIES, "single", counting)
    row = gate_rows(toylm, tmp_path, gates=["overfit"])["overfit"]
    assert row["verdict"] == "pass", row["reason"]
    updates = row["details"]["updates"]  # one micro batch per update; the load gate before it runs none
    assert updates > 0 and counting.calls == {"backward": updates, "clip_gradients": updates,
                                              "optimizer_step": updates}


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


@pytest.mark.parametrize(("precision", "computes"), [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                      ("fp16", torch.float16), ("fp32", torch.float32),
                                                      ("bf16-true", torch.bfloat16)])
def test_fsdp2_gathers_fp32_master_weights_in_the_dtype_the_estimate_counts(tmp_path, precision, computes):
    """Under bf16/fp16/fp8 the blocks compute with 2-byte copies gathered by FSDP2 (MixedPrecisionPolicy) while the
    shards stay fp32 and gradients are reduced in fp32: what the fsdp row's in-flight bytes count
    (fsdp.gather_dtype). fp32, and weights already bf16 (bf16-true: cast here by hand), are gathered as stored."""
    import torch.distributed as dist

    from pilotrun.distributed import DistEnv
    from pilotrun.strategies.fsdp import gather_dtype

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _Blocks()
        stored = torch.bfloat16 if precision == "bf16-true" else torch.float32
        model.to(stored)
        seen: list[torch.dtype] = []
        model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
        chosen = strategies.for_processes("fsdp", 2, "none", precision)
        assert strategies.get("fsdp").precision == "fp32"  # the registry's object untouched
        wrapped, how = chosen.wrap(model, DistEnv(0, 0, 1, "fsdp"), torch.device("cpu"))
        policy = wrapped.blocks[0]._get_fsdp_state()._fsdp_param_group.mp_policy
        wrapped(torch.ones(3, 4, dtype=stored)).float().sum().backward()
        low = gather_dtype(precision)
        assert seen == [computes] and (chosen.gathered_dtype() is None) == (low is None)
        assert all(p.dtype == stored for p in wrapped.parameters())  # the shards: master weights
        assert all(p.grad is not None and p.grad.dtype == stored for p in wrapped.parameters())
        assert policy.reduce_dtype == (torch.float32 if low else None)
        assert (f"parameters gathered in {low}, gradients reduced in fp32" in how) == (low is not None), how
    finally:
        dist.destroy_process_group()


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.tanh(self.mix(x))  # the residual inside the block, as in a transformer layer


class _WithBuffer(nn.Module):
    """A factory-style model whose float32 buffer joins the residual stream before the blocks (FSDP2 casts each
    block's inputs back to its gather dtype; the reload must too, or float32 meets bf16 weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.register_buffer("pe", torch.linspace(0, 1, 4))
        self.blocks = nn.ModuleList(_Residual() for _ in range(2))
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids):
        x = self.emb(input_ids) + self.pe
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(x)}


def test_the_reload_computes_as_fsdp2_gathered_whatever_joins_the_residual_stream(tmp_path):
    import copy

    import torch.distributed as dist

    from pilotrun.distributed import DistEnv
    from pilotrun.train.batches import dtype_names
    from pilotrun.workers.reload import compute_like_fsdp, outputs_computed_in

    torch.manual_seed(0)
    model = _WithBuffer()
    reloaded = copy.deepcopy(model)  # the export: the fp32 masters
    ids = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        live, _ = strategies.for_processes("fsdp", 2, "none", "bf16").wrap(model, DistEnv(0, 0, 1, "fsdp"),
                                                                          torch.device("cpu"))
        expected = outputs_computed_in(live, ids, torch.bfloat16)  # as the loop's view runs it
    finally:
        dist.destroy_process_group()
    assert dtype_names(reloaded.parameters()) == ["float32"]
    compute_like_fsdp(reloaded, torch.bfloat16)
    assert torch.equal(outputs_computed_in(reloaded, ids, torch.bfloat16), expected)
    assert reloaded.pe.dtype == torch.float32  # buffers as stored, as FSDP2 leaves them
