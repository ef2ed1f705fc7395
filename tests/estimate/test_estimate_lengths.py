"""Time at the data's lengths, memory at the longest (issue 42, item 5): the batch-length distribution, the split of
a micro batch's ops into the part linear in tokens and the attention kernels' part quadratic in the length, and an
estimate of the demo, whose examples are shorter than its max_length."""
from __future__ import annotations

import json

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.estimate.cache import TraceCache
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.lengths import (
    DATA_FILE,
    LONGEST,
    PAD_TO_LONGEST,
    DataLengths,
    batch_length_distribution,
    expected_micro,
    mean_length,
    split_ops,
    vocabulary_problem,
)
from pilotrun.estimate.model import estimate_fit
from pilotrun.estimate.ops import OpCosts
from pilotrun.estimate.runner import Traces
from pilotrun.models.attention import model_target_attention
from tests.conftest import EXAMPLES, pilotrun_cli


def test_the_longest_of_a_micro_batch_follows_the_examples_distribution_exactly():
    # Two examples of 10 tokens, one of 20, one of 40; a micro batch of 2 is as long as its longer example:
    # P(<= 10) = (2/4)^2 = 1/4, P(<= 20) = (3/4)^2 = 9/16, P(<= 40) = 1.
    dist = batch_length_distribution([(20, 1), (10, 2), (40, 1)], 2)
    assert [n for n, _ in dist] == [10, 20, 40]
    assert [p for _, p in dist] == pytest.approx([0.25, 9 / 16 - 0.25, 1 - 9 / 16])
    assert mean_length(dist) == pytest.approx(10 * 0.25 + 20 * 0.3125 + 40 * 0.4375)   # 26.25
    assert mean_length(batch_length_distribution([(20, 1), (10, 2), (40, 1)], 1)) == pytest.approx(20.0)
    assert mean_length(batch_length_distribution([(20, 1), (10, 2), (40, 1)], 64)) == pytest.approx(40.0, abs=1e-6)
    assert batch_length_distribution([], 4) == []


H100 = load_catalog()["H100-80GB"]
EFF = H100.efficiencies()
PEAK = H100.peak_flops("bf16") * EFF.compute
LINEAR = ["bf16", 4e12, 1e6, 3]          # compute-bound: 3 x 4e12 FLOPs
ATTENTION = ["bf16", 2e12, 1e6, 2]       # compute-bound at the traced length and at half of it
TRACED = {"ops": [LINEAR, ATTENTION], "attention_ops": [ATTENTION], "seq_len": 100, "batch_size": 1}
JOB = {"attention": {"implementation": "sdpa", "calls": 1}, "parameter_bytes": 0, "gradient_bytes": 0}
HALF = DataLengths(DATA_FILE, "", ((50, 7),), 7, 7, "data.jsonl", PAD_TO_LONGEST)


def test_linear_ops_scale_with_the_tokens_and_attention_with_the_square_of_the_length():
    assert split_ops(TRACED["ops"], TRACED["attention_ops"]) == ([LINEAR], [ATTENTION])
    at = expected_micro(JOB, TRACED, H100, EFF, HALF, 1, (1, True))
    linear, quadratic = 3 * 4e12 / PEAK, 2 * 2e12 / PEAK
    assert at.seconds == pytest.approx(linear * 0.5 + quadratic * 0.25)
    assert at.time_factor == pytest.approx((linear * 0.5 + quadratic * 0.25) / (linear + quadratic))
    assert at.flops_factor == pytest.approx((12e12 * 0.5 + 4e12 * 0.25) / 16e12)
    assert at.view["basis"] == DATA_FILE and at.view["mean_batch_length"] == 50 and at.view["longest"] == 100
    assert at.view["attention_share"] == pytest.approx(quadratic / (linear + quadratic), abs=1e-4)
    # Weights read and gradients written whatever the length: a floor above the scaled time is the time.
    heavy = {**JOB, "parameter_bytes": int(1e9), "gradient_bytes": int(1e9)}
    floor = 3e9 / (H100.bandwidth_tb_s * 1e12 * EFF.bandwidth)
    assert expected_micro(heavy, TRACED, H100, EFF, HALF, 1, (1, True)).seconds == pytest.approx(
        max(floor, linear * 0.5 + quadratic * 0.25))


@pytest.mark.parametrize("job, step, why", [
    ({**JOB, "attention": {"implementation": "eager", "calls": 1}}, TRACED, "eager attention"),
    (JOB, {k: v for k, v in TRACED.items() if k != "attention_ops"}, "written before it did"),
    (JOB, {**TRACED, "attention_ops": [["bf16", 1, 1, 1]]}, "not in the op table"),
])
def test_a_trace_that_cannot_separate_the_attention_stays_at_the_longest_and_says_why(job, step, why):
    at = expected_micro(job, step, H100, EFF, HALF, 1, (1, True))
    assert at.seconds is None and at.time_factor == 1.0 and at.view["basis"] == LONGEST
    assert why in at.view["note"] and at.view["note"].startswith("time at the longest length (100)")


def test_ranks_in_step_wait_for_the_longest_micro_batch_of_all_of_them():
    mixed = DataLengths(DATA_FILE, "", ((20, 1), (100, 1)), 2, 2, "data.jsonl", PAD_TO_LONGEST)
    one = expected_micro(JOB, TRACED, H100, EFF, mixed, 1, (1, True))
    four = expected_micro(JOB, TRACED, H100, EFF, mixed, 1, (4, True))
    assert one.view["mean_batch_length"] == 60 and four.view["mean_batch_length"] == pytest.approx(95)
    assert one.seconds < four.seconds


def test_a_placeholder_tokenizer_is_not_the_models():
    assert "placeholder" in vocabulary_problem(512, 32000)
    assert "not this model's" in vocabulary_problem(50000, 32000)
    assert vocabulary_problem(50277, 50368) is None and vocabulary_problem(512, None) is None


def test_op_costs_keep_the_attention_kernels_rows_apart():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with model_target_attention("sdpa"), OpCosts() as costs:   # as the trace runs it for a CUDA target
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v) * 2
        out.sum().backward()
    attention = costs.attention_rows()
    assert len(attention) == 2 and all(f > 0 for _, f, _, _ in attention)   # the kernel's forward and backward
    assert split_ops(costs.rows(), attention) is not None and len(costs.rows()) > 2


@pytest.mark.process
def test_estimate_of_mixed_length_data_is_timed_below_the_longest_with_memory_unchanged(tmp_path):
    """The demo's examples run from 16 to 71 tokens and are traced at data.max_length 96."""
    spec_path = EXAMPLES / "tiny-sft" / "pilot.yaml"
    res = pilotrun_cli("estimate", str(spec_path), "--accelerator", "H100-80GB", "--strategy", "single", "--json",
                       cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)["fits"][0]
    said = row["time_lengths"]
    assert said["basis"] == DATA_FILE and said["collate"] == PAD_TO_LONGEST and said["longest"] == 96
    assert said["sampled_examples"] == said["examples"] == 472 and 30 < said["mean_batch_length"] < 71
    assert "time at the data's lengths" in said["note"] and said["note"] in row["utilisation_source"]
    traces = Traces(load_spec(spec_path, check_files=False), cache=TraceCache.default())   # the command's trace
    longest = estimate_fit(traces.get(), H100, "single", 1)
    assert row["seconds_per_update"] < 0.8 * longest["seconds_per_update"]
    assert row["device_used_bytes"] == longest["device_used_bytes"]
    assert row["peak_allocated_bytes"] == longest["peak_allocated_bytes"]
