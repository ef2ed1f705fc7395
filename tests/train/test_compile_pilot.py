"""torch.compile in the pilot (issue 43, deliverable 2): train.compile in pilotrun's loop (whole model or per block,
in place), dynamo's counters as the first update's compile seconds and later recompiles, the check-time refusal,
and a compiled model noticed in a program's description.

The loop test compiles with the aot_eager backend (dynamo and AOT autograd, no C++ kernels built): inductor's C++
build of the tiny model's one block graph takes ~20-40 s on these 2 cores, aot_eager ~1-2 s."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pilotrun.config import SpecError, load_spec
from pilotrun.gates.base import Outcome
from pilotrun.gates.eval import _eval_compile
from pilotrun.gates.resume import _resume_compile
from pilotrun.gates.steps import _first_compile, _steady_compile
from pilotrun.ledger.records import Verdict
from pilotrun.models.structure import repeated_blocks
from pilotrun.train import compile as comp
from pilotrun.train.compile import DynamoCounts, apply_compile, compile_targets, compiled_scope, summed
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"
SMALL = ["train.micro_batch_size=2", "train.grad_accum_steps=1", "data.max_length=32", "train.device=cpu"]


class _Blocks(torch.nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class _Watching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_blocks_and_model_compile_in_place_keep_the_state_dict_and_are_detected():
    model = _Blocks()
    keys = list(model.state_dict())
    assert [n for n, _ in compile_targets(model, "blocks", repeated_blocks(model))] == ["layers.0", "layers.1", "layers.2"]
    assert compiled_scope(model, list(model.layers)) is None
    record = apply_compile(model, "blocks", repeated_blocks(model), backend="aot_eager")
    assert record is not None and record.targets == ["layers.0", "layers.1", "layers.2"]
    assert compiled_scope(model, list(model.layers)) == "blocks"
    assert list(model.state_dict()) == keys                     # in place: no _orig_mod. prefix
    copied = copy.deepcopy(model)                               # a private copy runs eager (Module.__getstate__)
    assert compiled_scope(copied, list(copied.layers)) is None
    whole = _Blocks()
    wrapper = torch.compile(whole, backend="aot_eager")   # the wrapper a user writes
    assert isinstance(wrapper, torch.nn.Module) and compiled_scope(wrapper, []) == "model"
    apply_compile(whole, "model", ("", []), backend="aot_eager")
    assert compiled_scope(whole, []) == "model" and apply_compile(_Blocks(), "off", ("", [])) is None
    with pytest.raises(ValueError, match="compile: model"):
        apply_compile(torch.nn.Sequential(torch.nn.Linear(2, 2)), "blocks", ("", []))


def test_counts_add_up_and_the_rows_say_compile_seconds_and_recompiles():
    assert summed([{"seq_len": 3}, {}]) is None                   # an eager job's records: no words
    extras = [{"compile_seconds": 1.5, "graphs_compiled": 1, "frames_run_eager": 0},
              {"compile_seconds": 0.0, "graphs_compiled": 0, "frames_run_eager": 0},
              {"compile_seconds": 2.0, "graphs_compiled": 2, "frames_run_eager": 1}]
    assert summed(extras) == DynamoCounts(3.5, 3, 1)
    first = Outcome(reason="update 1: loss 6")
    _first_compile(first, DynamoCounts(12.34, 1, 0), "blocks")
    assert first.verdict == Verdict.PASS and "compiled (train.compile: blocks) in 12.3 s" in first.reason
    assert first.details["compile"]["compile_seconds"] == 12.34
    quiet = Outcome(reason="fine")
    _steady_compile(quiet, DynamoCounts(0.0, 0, 0))
    assert quiet.verdict == Verdict.PASS and quiet.details["compile"]["recompiles"] == 0
    steady = Outcome(reason="fine")
    _steady_compile(steady, DynamoCounts(3.0, 2, 0))
    assert steady.verdict == Verdict.WARN and "2 recompile(s) during steady steps (3.0 s)" in steady.reason
    assert "pad batches" in steady.reason and steady.details["compile"]["recompiles"] == 2
    resumed = Outcome(reason="killed after update 2")
    _resume_compile(resumed, [{"step": 1, **extras[0]}], [{"step": 3, **extras[2]}])
    assert "the resumed process compiled again: 2.0 s, 2 graph(s)" in resumed.reason
    assert resumed.details["compile"]["control"]["compile_seconds"] == 1.5
    eager = Outcome(reason="killed after update 2")
    _resume_compile(eager, [{"step": 1}], [{"step": 3}])
    assert eager.reason == "killed after update 2" and "compile" not in eager.details
    ev = Outcome(reason="val loss 6")
    _eval_compile(ev, DynamoCounts(2.0, 1, 0), per_compile=1)    # eval mode's own graph: expected, no warning
    assert ev.verdict == Verdict.PASS and "compiled 1 graph(s) for evaluation" in ev.reason
    _eval_compile(ev, DynamoCounts(4.0, 3, 0), per_compile=1)
    assert ev.verdict == Verdict.WARN and "2 recompile(s) during eval" in ev.reason


@pytest.fixture
def static_shapes():
    """dynamo's automatic dynamic shapes off for one test, through its own config.patch (a monkeypatch.setattr on
    the config module is undone as a hidden key: the next compile in that worker raised AttributeError), and
    dynamo's caches emptied after it."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def test_the_loop_compiles_its_blocks_and_counts_the_compile_and_a_new_lengths_recompile(monkeypatch, static_shapes):
    from pilotrun.drivers import build_driver, join_job, load_inputs
    from pilotrun.drivers.build import check_job
    from pilotrun.drivers.loop import LoopDriver

    monkeypatch.setattr(comp, "BACKEND", "aot_eager")
    # A new length recompiles a static graph (as the first compile): the dynamic-shape graph dynamo makes by default
    # at the second length costs twice the trace here, and the count is the same.
    spec = load_spec(TINY, [*SMALL, "train.compile=blocks"])
    assert spec.config_hash() != load_spec(TINY, SMALL).config_hash()
    assert load_spec(TINY, [*SMALL, "train.compile=off"]).config_hash() == load_spec(TINY, SMALL).config_hash()
    process = join_job(spec)
    check_job(spec, process.device)
    before = comp.dynamo_counts()
    driver = build_driver(spec, load_inputs(spec), process)
    assert isinstance(driver, LoopDriver)
    try:
        assert comp.counts_since(before).graphs == 0            # the loss-policy probe ran eager: nothing compiled
        assert driver.compiled is not None and driver.compiled.targets == ["model.layers.0", "model.layers.1"]
        assert compiled_scope(driver.plain_model, repeated_blocks(driver.plain_model)[1]) == "blocks"
        with _Watching():   # as the CPU tensor tracker does in first_step: paused, or dynamo skips the code for good
            first = driver.update(pad_to=32)
        assert first.extra["compile_seconds"] > 0 and first.extra["graphs_compiled"] >= 1
        assert first.extra["tensor_tracking_paused"] is True
        assert driver.graphs_per_compile == first.extra["graphs_compiled"]
        same = driver.update(pad_to=32)
        assert same.extra["graphs_compiled"] == 0 and same.extra["compile_seconds"] == 0
        longer = driver.update(pad_to=40)                          # a new length: dynamo recompiles
        assert longer.extra["graphs_compiled"] >= 1 and longer.extra["compile_seconds"] > 0
        assert all(torch.isfinite(torch.tensor(r.loss)) for r in (first, same, longer))
    finally:
        driver.close()
    # Without a compiler inductor can use, the spec is refused before anything runs (exit 2), naming the field.
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}), pytest.raises(SpecError) as err:
        assert "C++ compiler" in str(comp.compiler_problem(torch.device("cpu")))
        check_job(spec, process.device)
    field, message = err.value.problems[0]
    assert field == "train.compile" and "compile: off" in message


def test_a_model_without_blocks_is_refused_at_check_time_naming_train_compile(toy):
    from pilotrun.drivers.build import check_job

    spec = load_spec(toy, ["train.compile=blocks"])
    with pytest.raises(SpecError) as err:
        check_job(spec, torch.device("cpu"))
    assert err.value.problems == [("train.compile", err.value.problems[0][1])]
    assert "compile: model" in err.value.problems[0][1]
    check_job(load_spec(toy, ["train.compile=model"]), torch.device("cpu"))   # the whole model: fine


def test_a_compiled_model_is_described_as_compiled():
    from types import SimpleNamespace

    from pilotrun.program.describe import JobFacts, accelerator_compile, describe_objects

    eager = describe_objects(_Blocks())
    assert eager.compile is None and eager.compile_source == ""
    blocks = _Blocks()
    apply_compile(blocks, "blocks", repeated_blocks(blocks), backend="aot_eager")
    facts = describe_objects(blocks)
    assert facts.compile == "blocks" and "per block" in facts.compile_source
    wrapper = torch.compile(_Blocks(), backend="aot_eager")
    assert isinstance(wrapper, torch.nn.Module)
    wrapped = describe_objects(wrapper)
    assert wrapped.compile == "model" and wrapped.parameters == facts.parameters
    later = describe_objects(_Blocks(), compile="model", compile_source="TrainingArguments.torch_compile")
    assert (later.compile, later.compile_source) == ("model", "TrainingArguments.torch_compile")
    assert JobFacts.from_dict(later.to_dict()).compile == "model"
    with pytest.raises(ValueError, match="compile"):
        JobFacts.from_dict({**later.to_dict(), "compile": "everything"})
    # accelerate's dynamo_plugin (Accelerator(dynamo_backend=...), the Trainer's torch_compile), read by attribute
    plugin = lambda backend, regional=False: SimpleNamespace(  # noqa: E731
        state=SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=SimpleNamespace(value=backend),
                                                            use_regional_compilation=regional)))
    assert accelerator_compile(plugin("NO")) == (None, "")
    assert accelerator_compile(plugin("INDUCTOR"))[0] == "model"
    assert accelerator_compile(plugin("INDUCTOR", regional=True))[0] == "blocks"
    assert accelerator_compile(None) == (None, "")


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_programs_stages_say_what_its_compiled_model_compiled_and_warn_on_a_steady_recompile(static_shapes):
    # A program measures its stages with pilotrun's Session (job.stage): on the CPU the tensor tracker is left off
    # around a compiled model (dynamo would skip the code under it, for good, and the model would run eager), and
    # each stage's row carries dynamo's counts.
    from pilotrun.api import Session

    rows: list[dict] = []
    session = Session("compiled-program", sink=rows.append, rank=0, world_size=1)
    torch.manual_seed(0)
    model = _Mlp()   # a class of the program's own: dynamo does not trace torch.nn's own frames (a Sequential)
    model.compile(backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def update(rows_in: int) -> None:
        model(torch.randn(rows_in, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for stage, size in (("first_step", 8), ("steady_step", 8), ("steady_step", 8), ("steady_step", 12)):
        with session.stage(stage, track=[model, opt]):
            update(size)
    first, same, again, longer = rows
    assert first["details"]["compile"]["graphs_compiled"] >= 1 and first["details"]["compile"]["compile_seconds"] > 0
    assert "torch.compile: " in first["reason"] and first["verdict"] == "pass"
    assert first["memory"]["not_measured"]["peak_allocated_bytes"] == comp.UNTRACKED
    assert same["details"]["compile"]["graphs_compiled"] == 0 and same["verdict"] == "pass"
    assert again["verdict"] == "pass"
    assert longer["verdict"] == "warn" and "recompile(s) during steady steps" in longer["reason"]
    assert "pad batches" in longer["reason"]
    # An eager program's rows carry no compile detail and no words about it.
    eager: list[dict] = []
    plain = torch.nn.Linear(4, 4)
    with Session("eager-program", sink=eager.append, rank=0, world_size=1).stage("first_step", track=[plain]):
        plain(torch.randn(2, 4)).sum().backward()
    assert "compile" not in eager[0]["details"] and "torch.compile" not in eager[0]["reason"]
