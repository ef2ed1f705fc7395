"""Prices from a documented catalog, costs beside every time, and a download that follows the model source."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pilotrun.cli.estimate import money
from pilotrun.config import load_spec
from pilotrun.estimate.catalog import DEFAULT_KEYS, OPTIONAL, REQUIRED, CatalogError, load_catalog
from pilotrun.estimate.plan import pipeline_hours
from pilotrun.estimate.source import ModelSource, model_download
from tests.conftest import EXAMPLES, pilotrun_cli
from tests.estimate.test_estimate import SHALLOW, synthetic_trace

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CATALOG = EXAMPLES / "catalog" / "my-gpus.yaml"
LLAMA = EXAMPLES / "llama-7b-estimate" / "pilot.yaml"


def test_the_documented_keys_are_the_keys_the_loader_accepts():
    doc = (ROOT / "docs" / "catalog.md").read_text()
    tables = doc.split("## Keys of an accelerator")[1]
    entry_part, defaults_part = tables.split("## Keys under `defaults`")
    documented = set(re.findall(r"^\| `(\w+)` \|", entry_part, re.M))
    assert documented == set(REQUIRED) | set(OPTIONAL)
    assert set(re.findall(r"^\| `(\w+)` \|", defaults_part.split("##")[0], re.M)) == set(DEFAULT_KEYS)


def test_the_example_catalog_loads_with_prices():
    cat = load_catalog(EXAMPLE_CATALOG)
    assert cat["H100-80GB"].price_per_gpu_hour == 2.99
    assert cat["H100-80GB"].memory_bytes == load_catalog()["H100-80GB"].memory_bytes  # only the price overridden
    assert cat["L40S-48GB"].price_per_gpu_hour == 0.99 and cat["L40S-48GB"].peak_flops("bf16") == 362e12
    assert cat["L40S-48GB"].memory_bytes == load_catalog()["L40S-48GB"].memory_bytes  # built in: price only
    new = cat["A100-40GB-PCIe"]  # not built in: the example gives every key
    assert "A100-40GB-PCIe" not in load_catalog() and new.memory_bytes == 42298834944 and new.price_per_gpu_hour == 1.29
    assert cat["H100-80GB"].defaults["headroom"] == 0.08
    assert cat["H100-80GB"].cost(2.0, 4) == pytest.approx(2.0 * 4 * 2.99)


@pytest.mark.parametrize("text, match", [
    ("accelerators:\n  H100-80GB: {price_per_hour: 2.5}\n", "unknown key.*price_per_hour.*price_per_gpu_hour"),
    ("accelerators:\n  H100-80GB: {price_per_gpu_hour: cheap}\n", "price_per_gpu_hour must be a number"),
    ("accelerators:\n  H100-80GB: {price_per_gpu_hour: -1}\n", "price_per_gpu_hour must be a number"),
    ("defaults: {head_room: 0.1}\naccelerators: {}\n", "unknown key.*head_room.*headroom"),
    ("accelerators:\n  H100-80GB: {efficiency: {compute: 1.5, bandwidth: 0.8}}\n",
     "H100-80GB.*efficiency takes compute and bandwidth, each a share in \\(0, 1\\]"),
    ("accelerators:\n  H100-80GB: {efficiency: 0.7}\n", "efficiency takes compute and bandwidth"),
    ("accelerators:\n  H100-80GB: {interconnect: {per_gpu_gb_s: 900, inter_node_gb_s: -50}}\n",
     "H100-80GB.*interconnect.inter_node_gb_s must be a number >= 0"),
])
def test_a_misspelt_or_wrong_catalog_key_is_named(tmp_path, text, match):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=match):
        load_catalog(path)


def test_no_price_says_which_entry_and_how():
    acc = load_catalog()["A100-80GB"]
    assert acc.cost(1.0, 1) is None
    assert "price_per_gpu_hour" in acc.price_note() and "A100-80GB" in acc.price_note()


def test_download_follows_the_model_source(tmp_path):
    config_built = model_download(load_spec(LLAMA, check_files=False))
    assert config_built["bytes"] == 0 and config_built["source"] is ModelSource.CONFIG
    assert "random weights" in config_built["reason"]
    # A local folder: its files' size.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 3000)
    (model / "config.json").write_text("{}")
    local = model_download(_hf_spec(tmp_path, "model"))
    assert local["source"] is ModelSource.LOCAL and local["bytes"] == 3002
    # A Hub id: the revision's files in the local cache, or "not measured" (never a guess from the parameters).
    hub = tmp_path / "hub"
    commit = "a" * 40
    snap = hub / "models--org--net" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"\0" * 5000)
    (hub / "models--org--net" / "refs").mkdir()
    (hub / "models--org--net" / "refs" / "main").write_text(commit)
    cached = model_download(_hf_spec(tmp_path, "org/net"), hub_cache=hub)
    assert cached["bytes"] == 5000 and cached["source"] is ModelSource.HUB and commit[:12] in cached["reason"]
    pinned = model_download(_hf_spec(tmp_path, "org/net", revision="b" * 40), hub_cache=hub)
    assert pinned["bytes"] is None and pinned["reason"].startswith("not measured") and "--model-gb" in pinned["reason"]
    absent = model_download(_hf_spec(tmp_path, "org/other"), hub_cache=hub)
    assert absent["bytes"] is None and "not in the local Hugging Face cache" in absent["reason"]
    given = model_download(_hf_spec(tmp_path, "org/other"), given_gb=1.5, hub_cache=hub)
    assert given["bytes"] == 1_500_000_000 and given["source"] is ModelSource.GIVEN


def _hf_spec(folder: Path, hf: str, revision: str | None = None):
    spec = load_spec(LLAMA, check_files=False)
    spec.model.config = None
    spec.model.hf = hf
    spec.model.revision = revision
    spec.source = str(folder / "pilot.yaml")
    return spec


def test_plan_items_carry_cost_and_the_download_of_the_source():
    spec = load_spec(LLAMA, check_files=False)
    row = {"gpus": 2, "price_per_gpu_hour": 3.0, "seconds_per_update": 2.0, "utilisation_source": "catalog default",
           "cost_note": None}
    download = model_download(spec)
    per_run = pipeline_hours(spec, row, synthetic_trace(), None, None, download)
    items = {i["item"]: i for i in per_run["items"]}
    assert items["model download"]["hours"] == 0 and "random weights" in items["model download"]["from"]
    assert items["training"]["hours"] == pytest.approx(2.0 * spec.train.updates / 3600)
    assert items["training"]["cost"] == pytest.approx(items["training"]["hours"] * 2 * 3.0)
    assert per_run["cost"] == pytest.approx(per_run["hours"] * 2 * 3.0)
    unknown = pipeline_hours(spec, row | {"price_per_gpu_hour": None, "cost_note": "no price"}, synthetic_trace(),
                             None, None, {"bytes": None, "reason": "not measured: test"})
    assert "model download" in unknown["unknown"] and unknown["cost"] is None and unknown["cost_note"] == "no price"


@pytest.mark.process
def test_select_markdown_json_and_plan_show_cost_where_they_show_time(tmp_path):
    common = [str(LLAMA), "--set", SHALLOW[0], "--catalog", str(EXAMPLE_CATALOG), "--accelerator", "H100-80GB",
              "--accelerator", "A100-80GB"]
    res = pilotrun_cli("select", *common, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = {r["accelerator"]: r for r in json.loads(res.stdout)["rows"]}
    h100 = rows["H100-80GB"]
    assert h100["cost_per_update"] == pytest.approx(h100["seconds_per_update"] / 3600 * h100["gpus"] * 2.99)
    assert h100["cost_for_planned_updates"] == pytest.approx(h100["hours_for_planned_updates"] * h100["gpus"] * 2.99)
    md = pilotrun_cli("select", *common, "--markdown", cwd=tmp_path)
    assert md.returncode == 0, md.stderr
    header = next(line for line in md.stdout.splitlines() if line.startswith("| accelerator"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    line = next(ln for ln in md.stdout.splitlines() if ln.startswith("| H100-80GB"))
    cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True))
    assert cells["cost for updates"] == money(h100["cost_for_planned_updates"])
    assert cells["cost/update"] == money(h100["cost_per_update"]) and cells["cost/update"] != "—"
    plan = pilotrun_cli("plan", *common, "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    per_run = {a["accelerator"]: a for a in json.loads(plan.stdout)["accelerators"]}["H100-80GB"]["per_run"]
    items = {i["item"]: i for i in per_run["items"]}
    assert items["model download"]["hours"] == 0 and "random weights" in items["model download"]["from"]
    assert per_run["cost"] == pytest.approx(per_run["hours"] * h100["gpus"] * 2.99)


@pytest.mark.process
def test_a_time_the_sheet_cannot_give_says_why_in_the_table_and_the_length_its_micro_batch(tmp_path):
    # Found by a new user: A10G's time was "n/a" with the reason only in --json, and "largest length" did not say it
    # was computed at the spec's micro batch while the row's own configuration used another.
    args = [str(LLAMA), "--set", SHALLOW[0], "--accelerator", "A10G-24GB"]
    rows = json.loads(pilotrun_cli("select", *args, "--json", cwd=tmp_path).stdout)["rows"]
    (a10g,) = rows
    assert a10g["fits"] and a10g["seconds_per_update"] is None and "no bf16 peak" in a10g["time_reason"], a10g
    spec = load_spec(LLAMA, check_files=False)
    assert a10g["largest_length_at_micro_batch"] == spec.train.micro_batch_size
    for form in ([], ["--markdown"]):
        res = pilotrun_cli("select", *args, *form, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        text = " ".join(res.stdout.split())
        assert f"A10G-24GB: time n/a: {a10g['time_reason']}" in text, text
        assert f"{a10g['largest_length']} at mb {spec.train.micro_batch_size}" in text, text


def test_the_report_shows_cost_beside_time_for_an_attached_selection_and_plan(tmp_path):
    from pilotrun.report.html import _attachments

    row = {"accelerator": "H100-80GB", "fits": True, "strategy": "fsdp", "gpus": 2, "micro_batch_size": 4,
           "grad_accum_steps": 8, "device_used_bytes": 70 * 2**30, "seconds_per_update": 2.5,
           "cost_per_update": 0.00347, "cost_for_planned_updates": 34.72, "software_stack": {"text": "CUDA 12"}}
    plan = {"accelerators": [{"accelerator": "H100-80GB", "plans": [
        {"days": 1, "gpus": 2, "fits_with_margin": True, "runs_that_fit": 3, "cost": 120.0, "advice": []}]}]}
    (tmp_path / "selection.json").write_text(json.dumps({"rows": [row]}))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    html = _attachments(tmp_path)
    assert "<th>cost/update</th>" in html and "<td>0.00347</td>" in html and "<td>34.72</td>" in html
    assert "<th>rental cost</th>" in html and "<td>120</td>" in html
