"""Memory counters on CPU: live tensor bytes are real, counters that do not exist say why."""
from __future__ import annotations

import torch

from pilotrun.measure import LiveTensorTracker, StageMeter

MB = 1 << 20


def test_tracker_counts_allocations_and_frees():
    model = torch.nn.Linear(256, 256)  # 256 KiB + 1 KiB
    with LiveTensorTracker(track=[model]) as t:
        base = t.live_bytes
        assert base == (256 * 256 + 256) * 4
        x = torch.empty(MB // 4)  # 1 MiB
        y = x.view(-1, 2)  # a view shares storage: not counted twice
        assert t.live_bytes == base + MB
        del x, y
        assert t.live_bytes == base
        z = torch.ones(2 * MB // 4)
        del z
    assert t.peak_bytes == base + 2 * MB


def test_tracker_sees_backward_and_optimizer_state():
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    with LiveTensorTracker(track=[model, opt]) as t:
        model(torch.randn(64, 512)).sum().backward()
        opt.step()
    # parameters + gradients + two AdamW moments are live at the end of the step, and nothing more: the activations
    # and the step's temporaries were freed, no view was counted again (+64 B: the optimizer's 0-dim step counters,
    # should a torch count them)
    assert 4 * params <= t.live_bytes <= 4 * params + 64
    # The peak adds the step's temporaries, at most two parameter-sized ones (sqrt(v) and its quotient in AdamW's
    # for-loop form); a free that is not subtracted or a view counted twice exceeds that.
    assert 4 * params <= t.peak_bytes <= 6 * params


def test_stage_meter_on_cpu_reports_real_numbers_and_reasons():
    model = torch.nn.Linear(128, 128)
    with StageMeter(torch.device("cpu"), track=[model]) as m:
        big = torch.randn(4 * MB // 4)
        del big
    mem = m.memory
    assert mem["peak_allocated_bytes"] >= 4 * MB
    assert mem["host_rss_peak_bytes"] > 10 * MB
    assert mem["peak_reserved_bytes"] is None and mem["device_used_bytes"] is None
    assert "cpu" in mem["not_measured"]["peak_reserved_bytes"]
    assert mem["state_bytes_before"]["parameters"] == (128 * 128 + 128) * 4
    assert m.seconds > 0


def test_manual_tracking_measures_only_the_tracked_block():
    with StageMeter(torch.device("cpu"), tensor_tracking="manual") as m:
        a = torch.empty(8 * MB // 4)  # not tracked: outside the block
        with m.track_tensors():
            b = torch.empty(MB // 4)
        del a, b
    assert MB <= m.memory["peak_allocated_bytes"] < 8 * MB


class CountingAllocator:
    """A backend whose allocator keeps peak counters (as CUDA's does), driven by the test: ``peak`` is what the
    allocator would report, ``reset_peaks`` starts it again."""

    allocator_counts = True
    device_type = "fake"

    def __init__(self) -> None:
        self.peak = 0

    def synchronize(self, device) -> None:
        pass

    def reset_peaks(self, device) -> None:
        self.peak = 0

    def peak_allocated(self, device):
        from pilotrun.backends import Reading

        return Reading(self.peak)

    peak_reserved = peak_allocated

    def alloc_retries(self, device):
        from pilotrun.backends import Reading

        return Reading(None, "fake")

    def device_used(self, device):
        from pilotrun.backends import Reading

        return Reading(None, "fake")


def test_a_paused_stretch_is_left_out_of_the_allocator_peaks_and_stopping_the_memory_ends_the_sampling(monkeypatch):
    from pilotrun.measure import meter as M

    fake = CountingAllocator()
    monkeypatch.setattr(M.backends, "for_device", lambda device: fake)
    with StageMeter(torch.device("cpu")) as m:
        fake.peak = 100 * MB          # the stage's own peak, before the pause
        m.pause()
        fake.peak = 500 * MB          # an evaluation inside the stage: not the stage's
        m.resume()                    # the counters start again here
        fake.peak = 50 * MB
        assert m.measuring_memory
        m.stop_memory()               # the rest of the stage is only timed
        assert not m.measuring_memory
        m.pause()                     # a pause after the sampling ended samples nothing
        m.resume()
    assert m.memory["peak_allocated_bytes"] == 100 * MB and m.memory["peak_reserved_bytes"] == 100 * MB
    assert m.memory["host_rss_peak_bytes"] > 0
