"""Your own loop, same rows: pilotrun.stage() measures a user's step into the same ledger."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import pilotrun
from pilotrun.humanize import human_bytes, human_seconds
from pilotrun.ledger import Ledger
from pilotrun.measure.meter import out_of_memory_reason


def test_stage_rows_in_a_users_loop(tmp_path):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    batch = torch.randn(32, 256)
    with pilotrun.session("my-job", ledger=tmp_path / "l.sqlite") as run:
        for step in range(3):
            name = "first_step" if step == 0 else "steady_step"
            with run.stage(name, inputs={"micro_batch_size": 32}, track=[model, opt]) as st:
                loss = model(batch).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                st.check_finite(loss=loss)
            row = st.row
            assert row["verdict"] == "pass" and row["seconds"] > 0
            assert row["inputs"]["micro_batch_size"] == 32
            if step == 2:
                # Measuring memory slows what it watches (the CPU's live-tensor tracker, the sampling thread): the
                # first steady_step stage was measured, this one is only timed and says why it has no peaks.
                assert row["memory"]["peak_allocated_bytes"] is None and row["memory"]["host_rss_peak_bytes"] is None
                assert "first 'steady_step' stage" in row["memory"]["not_measured"]["peak_allocated_bytes"]
                assert "first 'steady_step' stage" in row["memory"]["not_measured"]["host_rss_peak_bytes"]
                assert row["reason"] == (f"{human_seconds(row['seconds'])}; memory measured on the first "
                                         "'steady_step' stage only"), row["reason"]
                continue
            assert "host RSS" in row["reason"]
            # A passing row says what was measured, not just "pass".
            assert row["reason"].startswith(human_seconds(row["seconds"]) + "; peak allocated "
                                            + human_bytes(row["memory"]["peak_allocated_bytes"])), row["reason"]
            assert row["memory"]["peak_allocated_bytes"] >= sum(p.numel() * 4 for p in model.parameters())
    with Ledger(tmp_path / "l.sqlite") as led:
        (r,) = led.runs()
        assert r["name"] == "my-job" and r["kind"] == "stage" and r["status"] == "pass"
        rows = led.gate_rows(r["run_id"])
        assert [x["gate"] for x in rows] == ["first_step", "steady_step", "steady_step"]
        # The first update allocates AdamW state; later ones hold it during the whole step.
        assert rows[1]["memory"]["state_bytes_before"]["optimizer_state"] > 0
        assert rows[0]["memory"]["state_bytes_before"]["optimizer_state"] == 0


def test_a_stage_over_several_updates_says_their_number_and_the_time_per_update(tmp_path):
    # Found piloting a Trainer: its steady_step stage spans 3 updates and the row said "5.13 s", their total.
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pilotrun.session("spans", ledger=tmp_path / "l.sqlite") as run:
        with run.stage("steady_step", inputs={"updates": 3}, track=[model, opt]) as st:
            for _ in range(3):
                model(torch.randn(8, 64)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    row = st.row
    per = row["seconds"] / 3
    assert row["details"]["seconds_per_update"] == pytest.approx(per)
    assert row["reason"].startswith(f"3 updates in {human_seconds(row['seconds'])} ({human_seconds(per)} per "
                                    "update); peak allocated "), row["reason"]


def test_a_stage_counting_its_updates_tracks_the_first_times_the_rest_and_leaves_out_what_it_excludes(tmp_path):
    # Found piloting Lightning on CPU: job.stage(track=[model, opt]) around every update slowed a step from 2.6 s to
    # 4.5 s, and a steady_step stage included a 77.8 s validation.
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pilotrun.session("counted", ledger=tmp_path / "l.sqlite") as run:
        with run.stage("steady_step", inputs={"updates": 3}, track=[model, opt]) as st:
            for i in range(2):  # the program stopped after 2 of the 3 updates it meant to span
                model(torch.randn(8, 64)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                st.update_done()
                if i == 0:
                    with st.excluded("validation"):
                        big = torch.zeros(1 << 20)  # 4 MiB the update stage must not count
                        del big
    row = st.row
    assert row["inputs"]["updates"] == 2, "the updates it counted, not the ones it meant to"
    details = row["details"]
    assert details["updates_timed"] == 1 and len(details["update_seconds"]) == 2
    assert details["seconds_per_update"] == pytest.approx(details["update_seconds"][1])
    assert details["excluded"][0]["what"] == "validation"
    assert row["seconds"] >= sum(details["update_seconds"]), "the stage's clock runs on after its last update"
    assert row["memory"]["peak_allocated_bytes"] < 1 << 20, "the excluded stretch's tensor is not the stage's"
    assert row["reason"].startswith(f"2 updates in {human_seconds(row['seconds'])} "
                                    f"({human_seconds(details['seconds_per_update'])} per update over the 1 after "
                                    "the first, whose memory was measured); peak allocated "), row["reason"]
    assert "; validation excluded (" in row["reason"], row["reason"]


def test_exception_writes_a_fail_row_and_is_reraised(tmp_path):
    with pilotrun.session("oops", ledger=tmp_path / "l.sqlite") as run:
        with pytest.raises(ValueError, match="bad shape"):
            with run.stage("eval", inputs={"seq_len": 4096}) as st:
                raise ValueError("bad shape")
        assert st.row["verdict"] == "fail" and "ValueError: bad shape" in st.row["reason"]
        with run.stage("eval") as st2:
            st2.check_finite(loss=float("nan"))
        assert st2.row["verdict"] == "fail" and "loss is nan" in st2.row["reason"]
    with Ledger(tmp_path / "l.sqlite") as led:
        assert led.runs()[0]["status"] == "fail"


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
            "1.06 GiB is free.")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(CUDA_OOM), RuntimeError(CUDA_OOM)],
                         ids=["OutOfMemoryError", "RuntimeError"])
def test_an_accelerator_out_of_memory_is_not_called_host_memory_and_keeps_its_text(tmp_path, error):
    with pilotrun.session("oom", ledger=tmp_path / "l.sqlite") as run:
        with pytest.raises(type(error)):
            with run.stage("first_step", device="cpu") as st:  # the stage measured the CPU (nothing tracked)
                raise error
    reason = st.row["reason"]
    assert reason.startswith("first_step: out of accelerator memory") and "host memory" not in reason, reason
    assert f"{type(error).__name__}: {CUDA_OOM}" in reason
    assert st.row["details"]["failure"] == "out-of-memory"


def test_a_host_out_of_memory_says_host_and_keeps_its_text():
    reason = out_of_memory_reason(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                               "1099511627776 bytes"), torch.device("cpu"))
    assert reason.startswith("out of host memory (") and "DefaultCPUAllocator: can't allocate" in reason
    assert out_of_memory_reason(MemoryError(), torch.device("cpu")).startswith("out of host memory (")
    assert out_of_memory_reason(ValueError("out of memory"), torch.device("cpu")) is None  # not an allocator's


def test_check_finite_can_stop_the_loop_with_a_documented_exception(tmp_path):
    seen = []
    with pilotrun.session("nan", ledger=tmp_path / "l.sqlite") as run:
        with pytest.raises(pilotrun.StageFailed) as stop:
            for step in range(5):
                with run.stage("steady_step") as st:
                    seen.append(step)
                    st.check_finite(raise_on_fail=True, loss=float("nan") if step == 1 else 1.0)
    assert seen == [0, 1] and stop.value.failure == "non-finite" and stop.value.reason == "loss is nan"
    assert st.row["verdict"] == "fail" and st.row["reason"] == "loss is nan"
    assert st.row["details"]["failure"] == "non-finite"  # the row says what happened, not the exception's name
    with Ledger(tmp_path / "l.sqlite") as led:
        assert [r["verdict"] for r in led.gate_rows(led.runs()[0]["run_id"])] == ["pass", "fail"]


@pytest.mark.process
def test_module_level_stage_in_a_script(tmp_path):
    script = textwrap.dedent("""
        import torch, pilotrun
        m = torch.nn.Linear(8, 8)
        with pilotrun.stage("load", track=[m]):
            pass
        with pilotrun.stage("first_step", inputs={"micro_batch_size": 2}, track=[m]):
            m(torch.randn(2, 8)).sum().backward()
    """)
    (tmp_path / "train.py").write_text(script)
    res = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with Ledger(tmp_path / "runs" / "ledger.sqlite") as led:
        (r,) = led.runs()
        assert r["name"] == "train" and r["status"] == "pass" and r["ended_at"]
        assert [x["gate"] for x in led.gate_rows(r["run_id"])] == ["load", "first_step"]
