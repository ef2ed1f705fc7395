"""Planning a campaign is linear in its runs: the base spec is read once, each value's spec is built and checked once
(a further seed of it is that spec with the seed set), and every declared run's row is written in one transaction.
Counted, not timed: 10,000 declared runs ask the spec loader exactly what 20 do."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pilotrun.campaign import orchestrate
from pilotrun.campaign import spec as campaign_spec
from pilotrun.campaign.spec import load_campaign, run_spec
from pilotrun.config import load as config_load
from pilotrun.ledger.records import RunKind, RunStatus
from pilotrun.ledger.store import Ledger
from tests.conftest import FIXTURES


class _FirstRun(Exception):
    """Raised where the first run would start: planning is over."""


def _sweep(tmp_path: Path, values: int, seeds: int) -> Path:
    shutil.copytree(FIXTURES / "toy", tmp_path / "toy")
    body = {"name": "wide", "base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": [0.01 + i * 1e-4
                                                                                         for i in range(values)]},
            "seeds": list(range(1, seeds + 1)), "updates": 2, "eval": {"every": 2},
            "keep": {"checkpoint": False, "export": False, "control_set": 0}}
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _plan(tmp_path: Path, values: int, seeds: int, monkeypatch) -> tuple[dict, list[dict]]:
    """run_campaign up to its first run's start, counting the reads and builds of specs on the way."""
    calls = {"load_spec": 0, "spec_from_mapping": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    def first_run(runs, *args, **kwargs):
        raise _FirstRun(runs)

    with monkeypatch.context() as m, pytest.raises(_FirstRun) as planned:
        m.setattr(config_load, "load_spec", counted("load_spec", config_load.load_spec))
        m.setattr(campaign_spec, "spec_from_mapping", counted("spec_from_mapping", campaign_spec.spec_from_mapping))
        m.setattr(orchestrate, "execute", first_run)
        orchestrate.run_campaign(_sweep(tmp_path, values, seeds), tmp_path / "l.sqlite", tmp_path / "runs")
    return calls, planned.value.args[0]


@pytest.mark.process  # the lock asks git about the base's folder
def test_ten_thousand_declared_runs_read_the_base_once_and_build_each_value_once(tmp_path, monkeypatch):
    (tmp_path / "small").mkdir()
    small, _ = _plan(tmp_path / "small", 4, 5, monkeypatch)
    (tmp_path / "large").mkdir()
    large, runs = _plan(tmp_path / "large", 100, 100, monkeypatch)
    # The campaign file's check and the one reading for the runs: the same for 20 runs as for 10,000.
    assert small["load_spec"] == large["load_spec"] == 2, (small, large)
    assert (small["spec_from_mapping"], large["spec_from_mapping"]) == (4, 100)  # once per value, not per run
    assert len(runs) == 10_000 and len({r["run_id"] for r in runs}) == 10_000
    with Ledger(tmp_path / "large" / "l.sqlite") as led:
        camp = led.runs(kind=RunKind.CAMPAIGN)[0]
        rows = led.campaign_runs(camp["run_id"])
    assert [r["run_id"] for r in rows] == [r["run_id"] for r in runs]  # every declared run, in order, planned
    assert {r["status"] for r in rows} == {RunStatus.PLANNED}
    # A seed's spec made from its value's checked spec is the spec building it would give: the same mapping (what
    # the worker runs from) and the same config hash (what the row records).
    c = load_campaign(tmp_path / "large" / "wide.yaml")
    for i in (0, 1, 99, 5_050, 9_999):
        r, row = runs[i], rows[i]
        built = run_spec(c, r["variant"], r["seed"])
        assert r["spec"].written == built.written and r["spec"].seed == built.seed == r["seed"]
        assert row["config_hash"] == built.config_hash() == r["spec"].config_hash()
        assert row["meta"]["seed"] == r["seed"] and row["meta"]["variant"] == r["variant"]
        assert Path(row["out_dir"]).is_dir()
    assert len({row["config_hash"] for row in rows}) == 10_000  # value and seed both reach the hash


def test_a_program_campaigns_runs_are_built_per_seed_with_the_seed_in_their_command(tmp_path):
    """A program's seed is in its command line and environment (the campaign's templates), not one number a spec
    can set alone: each of its runs is built, and each differs from the run of the next seed only there."""
    from tests.campaign.test_campaign_program import _setup

    c = load_campaign(_setup(tmp_path))
    runs, problems = orchestrate.prepare(c)
    assert problems == [] and len(runs) == len(c.values) * len(c.seeds) >= 4
    for r in runs:
        built = run_spec(c, r["variant"], r["seed"])
        assert r["spec"].written == built.written and r["config_hash"] == built.config_hash()
        words = r["spec"].program.words
        assert words[words.index("--seed") + 1] == str(r["seed"])
    assert len({r["config_hash"] for r in runs}) == len(runs)


def test_the_run_plan_is_typed_and_a_dict_only_on_the_wire():
    import json

    from pilotrun.campaign.run_plan import CampaignRunPlan

    plan = CampaignRunPlan(updates=12, eval_every=4, stop={"divergence": 3.0}, keep_checkpoint=False,
                           control_set=8, processes=2).with_threads(1)
    wire = json.loads(json.dumps(plan.to_json()))
    assert wire["keep"] == {"checkpoint": False, "export": True, "control_set": 8} and wire["threads"] == 1
    assert CampaignRunPlan.from_json(wire) == plan
    # A plan.json an earlier pilotrun wrote (no processes, no threads, keep without export) still reads.
    old = {"updates": 6, "eval_every": 2, "stop": {}, "keep": {"checkpoint": True, "control_set": 16}}
    assert CampaignRunPlan.from_json(old) == CampaignRunPlan(updates=6, eval_every=2)
