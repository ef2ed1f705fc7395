"""LoRA / QLoRA adapters, bf16-true and the new optimizers, on the demo's tiny Llama (examples/lora-sft): the real
peft, bitsandbytes (its CPU kernels) and transformers, small models, in this process unless a test says otherwise."""
from __future__ import annotations

import json

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.config.schema import SpecError
from tests.conftest import copy_example, copy_fixture, gate_rows, pilotrun_cli

SMALL = ["train.micro_batch_size=2", "train.grad_accum_steps=1"]
QLORA = ["model.quantization={bits: 4, type: nf4, double_quant: true, compute_dtype: fp32}"]


@pytest.fixture
def lora_spec(tmp_path):
    copy_example("tiny-sft", tmp_path)  # the example's data and tokenizer (../tiny-sft/)
    return copy_example("lora-sft", tmp_path)


def _driver(spec_path, *overrides):
    from pilotrun.drivers import build_driver, join_job, load_inputs

    spec = load_spec(spec_path, [*SMALL, *overrides])
    process = join_job(spec)
    return build_driver(spec, load_inputs(spec), process)


def _trainable(driver) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in driver.model.named_parameters() if p.requires_grad}


# -- invalid combinations: exit 2 naming the field and the fix -------------------------------------------------

def test_target_modules_the_model_lacks_lists_its_linear_names(lora_spec):
    from pilotrun.drivers import check_job

    spec = load_spec(lora_spec, ["model.adapter.target_modules=[q_proj, query]"])
    with pytest.raises(SpecError) as err:
        check_job(spec, torch.device("cpu"))
    field, message = err.value.problems[0]
    assert field == "model.adapter.target_modules"
    assert "query is not the name of a Linear layer" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in message


@pytest.mark.process
def test_cli_exit_2_without_traceback_for_missing_targets(lora_spec, tmp_path):
    proc = pilotrun_cli("run", str(lora_spec), "--set", "model.adapter.target_modules=[qkv]", "--out",
                        str(tmp_path / "o"), "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path, timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "model.adapter.target_modules" in text and "q_proj" in text
    assert "Traceback" not in text


def test_fused_true_where_torch_has_no_kernel_names_the_field():
    from pilotrun.config.sections import OptimizerSpec
    from pilotrun.train.optim import OptimizerError, choose_fused

    with pytest.raises(OptimizerError) as err:
        choose_fused(OptimizerSpec(lr=1e-3, fused=True), torch.device("meta"), {torch.float32})
    assert err.value.field == "train.optimizer.fused" and "set it to auto or false" in str(err.value)
    with pytest.raises(OptimizerError):
        choose_fused(OptimizerSpec(lr=1e-3, fused=True), torch.device("cpu"), {torch.int8})
    fused, why = choose_fused(OptimizerSpec(lr=1e-3), torch.device("cpu"), {torch.float32})
    assert fused is False and "auto" in why and "CPU" in why
    fused, why = choose_fused(OptimizerSpec(lr=1e-3, fused=True), torch.device("cpu"), {torch.bfloat16})
    assert fused is True


def test_check_job_refuses_fused_true_without_a_kernel(lora_spec):
    from pilotrun.drivers import check_job

    spec = load_spec(lora_spec, ["train.optimizer.fused=true"])
    check_job(spec, torch.device("cpu"))  # torch has a fused CPU AdamW
    with pytest.raises(SpecError) as err:
        check_job(spec, torch.device("meta"))
    assert err.value.problems[0][0] == "train.optimizer.fused"


def test_accum_equivalence_for_bf16_true_adapter_on_a_float64_copy(lora_spec, tmp_path):
    rows = gate_rows(lora_spec, tmp_path, "train.precision=bf16-true", gates=["accum_equivalence"])
    row = rows["accum_equivalence"]
    assert row["verdict"] == "pass", row["reason"]
    assert row["details"]["dtype"] == "float64"
    assert all(w["relative_grad_difference"] < 1e-9 for w in row["details"]["windows"])


def test_fused_true_builds_torch_fused_adamw_over_trainable_params_only(lora_spec):
    driver = _driver(lora_spec, "train.optimizer.fused=true")
    try:
        assert driver.optimizer.defaults["fused"] is True
        assert driver.optimizer_choice.fused is True
        in_opt = {id(p) for g in driver.optimizer.param_groups for p in g["params"]}
        trainable = {id(p) for p in driver.model.parameters() if p.requires_grad}
        frozen = [n for n, p in driver.model.named_parameters() if not p.requires_grad]
        assert in_opt == trainable and frozen and all("lora_" in n for n, p in driver.model.named_parameters()
                                                       if p.requires_grad)
    finally:
        driver.close()


# -- the paths bitsandbytes runs on CPU, for real ------------------------------------------------------------

def test_qlora_4bit_with_adamw8bit_trains_the_adapter_only(lora_spec):
    import bitsandbytes as bnb

    driver = _driver(lora_spec, *QLORA, "train.optimizer.name=adamw8bit")
    try:
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in driver.model.modules())
        assert isinstance(driver.optimizer, bnb.optim.AdamW8bit)
        before = _trainable(driver)
        frozen_before = driver.loaded.base_identity
        losses = [driver.update().loss for _ in range(2)]
        after = _trainable(driver)
        assert all(map(lambda x: x == x, losses))  # finite (not NaN)
        assert any(not torch.equal(before[n], after[n]) for n in before)  # the adapter moved
        from pilotrun.models.adapters import parameter_split

        split = parameter_split(driver.model)
        assert split.trainable == sum(t.numel() for t in after.values()) and split.frozen > split.trainable
        assert driver.loaded.base_identity == frozen_before
    finally:
        driver.close()


def test_bf16_true_holds_weights_and_adamw_state_in_bf16_without_autocast(lora_spec):
    from pilotrun.train.batches import autocast_for

    driver = _driver(lora_spec, "train.precision=bf16-true")
    try:
        assert {p.dtype for p in driver.model.parameters()} == {torch.bfloat16}
        driver.update()
        states = [v for st in driver.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        assert states and {v.dtype for v in states} == {torch.bfloat16}
        assert not isinstance(autocast_for(torch.device("cpu"), "bf16-true"), torch.autocast)
    finally:
        driver.close()


def test_adafactor_on_bf16_true_with_documented_settings(lora_spec):
    from transformers.optimization import Adafactor

    driver = _driver(lora_spec, "train.precision=bf16-true", "train.optimizer.name=adafactor",
                     "train.optimizer.lr=0.01")
    try:
        assert isinstance(driver.optimizer, Adafactor)
        group = driver.optimizer.param_groups[0]
        assert group["relative_step"] is False and group["scale_parameter"] is False
        assert group["warmup_init"] is False and group["lr"] == pytest.approx(0.01 * driver.scheduler.lr_lambdas[0](0))
        before = _trainable(driver)
        driver.update()
        assert any(not torch.equal(before[n], p) for n, p in _trainable(driver).items())
        st = next(iter(driver.optimizer.state.values()))
        assert "exp_avg_sq_row" in st and "exp_avg" not in st  # factored, no first moment
    finally:
        driver.close()


# -- where a kernel does not exist: skip with the reason, never a fake pass ---------------------------------------

def test_paged_optimizer_on_cpu_is_not_measured(lora_spec, tmp_path):
    """bitsandbytes 0.50 runs PagedAdamW8bit on CPU without paging anything (its state is ordinary memory):
    the load gate says so and nothing after it runs."""
    import bitsandbytes

    rows = gate_rows(lora_spec, tmp_path, "train.optimizer.name=paged_adamw8bit", gates=["first_step"])
    assert rows["load"]["verdict"] == "skip"
    assert rows["load"]["reason"] == (f"not measured: paged optimizer state needs cuda "
                                      f"(bitsandbytes {bitsandbytes.__version__})")
    assert rows["first_step"]["verdict"] == "skip"


def test_qlora_gradients_after_an_eval_forward_are_those_without_it(lora_spec):
    """bitsandbytes 0.50.2 repacks 4-bit weights on a CPU eval forward and then trains through gemv_4bit, which has
    no autograd kernel; the builder turns that off, so evaluating between updates leaves the gradients unchanged."""
    from pilotrun.models.loading import build_model

    spec = load_spec(lora_spec, [*QLORA, "model.adapter.dropout=0.0"])
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))

    def grads(evaluate_first: bool) -> dict[str, torch.Tensor]:
        model = build_model(spec.model, spec.build_context()).model
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        with torch.no_grad():  # B starts at zero; make A's gradient depend on the path through the base
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, after_eval = grads(False), grads(True)
    first = next(n for n in plain if "layers.0." in n and "lora_A" in n)
    assert plain[first].abs().max() > 0
    assert all(torch.equal(plain[n], after_eval[n]) for n in plain)


def test_one_function_decides_availability(lora_spec, tmp_path, monkeypatch):
    from pilotrun.models import quantize

    monkeypatch.setattr(quantize, "bnb_version", lambda: None)
    assert quantize.kernel_problem(quantize.Kernel.MATMUL_4BIT, "cpu").startswith(
        "not measured: 4-bit matmul needs bitsandbytes")
    monkeypatch.undo()
    monkeypatch.setattr(quantize, "SUPPORTED", {**quantize.SUPPORTED, quantize.Kernel.MATMUL_4BIT: frozenset({"cuda"})})
    rows = gate_rows(lora_spec, tmp_path, *QLORA, gates=["load"])
    assert rows["load"]["verdict"] == "skip"
    assert rows["load"]["reason"].startswith("not measured: 4-bit matmul needs cuda (bitsandbytes ")


# -- checkpoints hold the adapter alone; restore is exact ----------------------------------------------------------

def test_an_adapter_on_a_random_base_that_learns_but_cannot_memorise_warns_and_one_that_does_not_learn_fails(
        lora_spec, tmp_path):
    # At Llama's default init (0.02) the frozen random embeddings bound the logits: no adapter memorises the subset
    # (the example raises initializer_range for that). That is the base, not a defect: warn, saying so.
    random_base, short = "model.config.initializer_range=0.02", "pilot.overfit.max_updates=20"
    row = gate_rows(lora_spec, tmp_path / "a", random_base, short, gates=["overfit"])["overfit"]
    assert row["verdict"] == "warn", row["reason"]
    assert "randomly initialised (built from a config)" in row["reason"] and "frozen" in row["reason"]
    # An adapter whose loss does not move (lr too small to change it) is still a failure.
    row = gate_rows(lora_spec, tmp_path / "b", random_base, short, "train.optimizer.lr=1e-9",
                   gates=["overfit"])["overfit"]
    assert row["verdict"] == "fail", row["reason"]


def test_the_frozen_base_shortfall_rule():
    from pilotrun.gates.overfit import frozen_base_shortfall

    assert frozen_base_shortfall(4.5, 4.2, 0.99, random_base=True)      # learns, random base: warn
    assert frozen_base_shortfall(4.5, 4.2, 0.99, random_base=None)      # cannot tell: warn, naming both cases
    assert frozen_base_shortfall(4.5, 4.2, 0.99, random_base=False) is None   # pretrained base: a failure
    assert frozen_base_shortfall(4.5, 4.2, 0.0, random_base=True) is None     # full fine-tune: a failure
    assert frozen_base_shortfall(4.5, 4.49, 0.99, random_base=True) is None   # the loss did not fall: a failure

def test_save_holds_adapter_not_base_and_restore_continues_bitwise(lora_spec, tmp_path):
    from pilotrun.checkpoint.io import CheckpointError, read_manifest
    from pilotrun.checkpoint.state import compare_fingerprints, load_torch_file

    a = _driver(lora_spec, "train.optimizer.name=adamw8bit")
    b = _driver(lora_spec, "train.optimizer.name=adamw8bit")
    other = _driver(lora_spec, "train.optimizer.name=adamw8bit", "seed=99")
    try:
        for _ in range(2):
            a.update()
        a.save(tmp_path / "ckpt")
        expected = a.fingerprint()
        manifest = read_manifest(tmp_path / "ckpt")
        assert manifest["base_identity"] == a.loaded.base_identity
        shards = [n for n in manifest["files"] if n.startswith("model-")]
        saved = {k for n in shards for k in load_torch_file(tmp_path / "ckpt" / n)["entries"]}
        assert saved == {n for n, p in a.model.named_parameters() if p.requires_grad}
        assert all("lora_" in k for k in saved)
        ra = a.update()  # the random streams are global to the process: a runs on, then b restores them
        b.restore(tmp_path / "ckpt")
        assert compare_fingerprints(expected, b.fingerprint()) == []
        rb = b.update()
        assert ra.loss == rb.loss and ra.sample_ids == rb.sample_ids
        assert all(torch.equal(x, y) for x, y in zip(_trainable(a).values(), _trainable(b).values()))
        with pytest.raises(CheckpointError, match="trained on another base"):
            other.restore(tmp_path / "ckpt")
    finally:
        for d in (a, b, other):
            d.close()


# -- the export: PEFT artifact, loaded on its base, refused when tampered -------------------------------------------

def test_export_reloads_on_rebuilt_base_and_tampering_is_refused(lora_spec, tmp_path):
    from pilotrun.checkpoint.trust import LoadPolicy, LoadRefused, Refusal
    from pilotrun.train.evaluation import outputs_of
    from pilotrun.workers.reload import load_artifact

    driver = _driver(lora_spec)
    try:
        for _ in range(2):
            driver.update()
        written = driver.write_export(tmp_path / "export")
        data = driver.data
        batch = {k: v for k, v in data.collate([data.val[i] for i in range(4)]).items()}
        control = outputs_of(driver.model, batch)
    finally:
        driver.close()
    folder = tmp_path / "export"
    files = set(written.files)
    assert {"adapter_model.safetensors", "adapter_config.json", "base.json"} <= files
    assert "merged/model.safetensors" in files  # export.merge: true in the example
    assert not any(n == "model.safetensors" for n in files)  # the frozen base is not exported
    base = json.loads((folder / "base.json").read_text())
    assert base["base_identity"] and "PeftModel.from_pretrained" in base["how_to_load"]
    known = LoadPolicy.of({written.manifest_sha256})
    reloaded = load_artifact(folder, known)
    assert torch.equal(outputs_of(reloaded, batch), control)
    with pytest.raises(LoadRefused) as err:
        load_artifact(folder, LoadPolicy.of(set()))
    assert err.value.kind is Refusal.UNKNOWN
    raw = bytearray((folder / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (folder / "adapter_model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(LoadRefused) as err:
        load_artifact(folder, known)
    assert err.value.kind is Refusal.DAMAGED and "adapter_model.safetensors" in str(err.value)


def test_an_adapter_export_on_a_factory_base_is_rebuilt_from_the_spec_folder_with_its_mapping(tmp_path, monkeypatch):
    """The reload builds the base from base.json's spec: its factory imported from the spec's folder (not the
    current directory) and called with the model mapping as written (dim 24, not the factory's default 48)."""
    from pilotrun.checkpoint.trust import LoadPolicy
    from pilotrun.train.evaluation import outputs_of
    from pilotrun.workers.reload import load_artifact

    driver = _driver(copy_fixture("toylm", tmp_path), "model.adapter={target_modules: [head]}", "model.dim=24")
    try:
        driver.update()
        written = driver.write_export(tmp_path / "export")
        batch = driver.data.collate([driver.data.val[i] for i in range(4)])
        control = outputs_of(driver.model, batch)
    finally:
        driver.close()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    reloaded = load_artifact(tmp_path / "export", LoadPolicy.of({written.manifest_sha256}))
    assert torch.equal(outputs_of(reloaded, batch), control)


# -- the example, every gate, for real ------------------------------------------------------------------------------

@pytest.mark.process
def test_lora_example_passes_every_gate_and_its_archive_reloads_the_adapter(lora_spec, tmp_path):
    import subprocess
    import sys
    import tarfile

    from pilotrun.ledger.store import Ledger
    from pilotrun.pilot import PilotOptions, run_pilot
    from pilotrun.report.archive import archive_run

    result = run_pilot(load_spec(lora_spec), PilotOptions(out_dir=tmp_path / "out", ledger_path=tmp_path / "l.sqlite"))
    rows = {r["gate"]: r for r in result.rows}
    bad = {g: (r["verdict"], r["reason"]) for g, r in rows.items() if r["verdict"] not in ("pass", "warn")}
    assert not bad, bad
    load = rows["load"]["details"]
    assert 0 < load["trainable_parameters"] < load["frozen_parameters"]
    assert load["trainable_bytes"] > 0 and load["base_identity"]
    assert "bitwise" in rows["resume"]["reason"] or rows["resume"]["details"].get("exact") is True
    assert rows["export"]["details"]["adapter"] is True and rows["export"]["details"]["merged"] == "merged"
    assert "identity checked" in rows["reload_eval"]["reason"]
    assert rows["reload_eval"]["details"]["merged"]["max_abs_difference"] > 0  # the trained adapter, merged
    assert "adapter" in rows["inspect"]["details"]
    led = Ledger(tmp_path / "l.sqlite")
    try:
        out, _ = archive_run(led, result.run_id, tmp_path / "a.tar.gz")
    finally:
        led.close()
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    root = next((tmp_path / "x").iterdir())
    for name in ("model/adapter_model.safetensors", "model/adapter_config.json", "model/base.json",
                 "model/merged/model.safetensors", "rerun_control.py"):
        assert (root / name).is_file(), name
    assert not (root / "model" / "model.safetensors").exists()
    assert "PeftModel.from_pretrained(base, 'model')" in (root / "README.md").read_text()
    rerun = subprocess.run([sys.executable, "rerun_control.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "PeftModelForCausalLM reproduces" in rerun.stdout, rerun.stdout + rerun.stderr
