"""Matmuls off the tensor cores' alignment (estimate/alignment.py): found in the trace, said in the time row as a
lower bound with the fix, never silently timed as aligned ones."""
from __future__ import annotations

import json

import pytest
import torch

from pilotrun.estimate.alignment import unaligned_view
from pilotrun.estimate.model import time_source
from pilotrun.estimate.ops import OpCosts
from tests.conftest import EXAMPLES, pilotrun_cli

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def _gpt2_step(vocab: int, dtype=torch.bfloat16, seq: int = 16, attention: str = "sdpa") -> OpCosts:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=32, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (2, seq))
    with OpCosts() as costs, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        model(input_ids=ids, labels=ids).loss.backward()
    return costs


def test_the_head_of_an_odd_vocabulary_is_found_in_forward_and_both_gradients():
    costs = _gpt2_step(131)
    rows = costs.unaligned_rows()
    # The forward (32 tokens x 131 x 64), the input's gradient (K = 131) and the weight's (M = 131): each has 131 as a
    # leading dimension; the token count (32) is none.
    assert sorted((m, n, k) for _, m, n, k, *_ in rows) == sorted([(32, 131, 64), (32, 64, 131), (131, 64, 32)])
    assert all(r[0] == "bf16" and r[5] == 1 and r[6] == [131] for r in rows)
    assert "lm_head" in {m for r in rows for m in r[7]}
    view = unaligned_view({"ops": costs.rows(), "unaligned_matmuls": rows, "seq_len": 16})
    head_flops = 3 * 2 * 32 * 131 * 64
    assert view["flops_share"] == pytest.approx(head_flops / costs.get_total_flops())
    assert view["dimensions"] == [{"size": 131, "padded": 192, "what": "features"}]
    assert "lm_head" in view["modules"]
    assert "lower bound" in view["note"] and "pad_to_multiple_of=64" in view["note"]


def test_an_odd_token_count_is_no_leading_dimension_but_eager_scores_at_an_odd_length_are():
    """A Linear's rows are its tokens: 2 x 15 of them leave every GEMM aligned. Eager attention's scores have the
    sequence length as their row length: at 15 those matmuls are flagged, with the collator's padding as the fix."""
    rows = _gpt2_step(128, seq=15, attention="eager").unaligned_rows()
    assert all(30 not in r[6] for r in rows)   # 2 x 15 tokens: the Linears' row count, never a leading dimension
    assert rows and all(15 in r[6] for r in rows)
    assert {m for r in rows for m in r[7]} <= {"transformer.h.*.attn", "transformer.h.*", "transformer"}
    view = unaligned_view({"ops": [["bf16", sum(r[4] * r[5] for r in rows), 1, 1]], "unaligned_matmuls": rows,
                           "seq_len": 15})
    assert view["dimensions"] == [{"size": 15, "padded": 16, "what": "sequence length"}]
    assert "pad_to_multiple_of=8" in view["note"] and "resize_token_embeddings" not in view["note"]


def test_aligned_dimensions_and_fp32_matmuls_are_not_flagged():
    assert _gpt2_step(128).unaligned_rows() == []
    assert _gpt2_step(131, torch.float32).unaligned_rows() == []   # fp32: no tensor cores (TF32 off by default)


def test_a_small_share_is_not_said_and_an_old_trace_has_nothing_to_say():
    ops = [["bf16", 10**12, 10**6, 10]]
    tiny_head = [["bf16", 4096, 2, 768, 2 * 4096 * 2 * 768, 3, [2], ["classifier"]]]
    assert unaligned_view({"ops": ops, "unaligned_matmuls": tiny_head}) is None
    assert unaligned_view({"ops": ops}) is None


def test_the_time_row_says_lower_bound_and_the_padding():
    view = unaligned_view({"ops": [["bf16", 10**9, 10, 1]], "unaligned_matmuls": [
        ["bf16", 32, 131, 64, 10**9 // 2, 1, [131], ["lm_head"]]]})
    t = {"model": "roofline", "seconds": 1.0, "memory_bound_seconds": 0.1, "compute_efficiency": 0.7,
         "bandwidth_efficiency": 0.8, "efficiency_source": "defaults", "unaligned_matmuls": view}
    assert ("a lower bound: 50% of the FLOPs in matmuls off the tensor cores' alignment (lm_head; pad 131 -> 192)"
            in time_source(t))


@pytest.mark.process   # the estimate traces in a worker process
def test_estimate_says_the_odd_vocabulary_and_its_fix(tmp_path):
    """The demo at bf16 with one token more than its 512: the estimate's time is called a lower bound and the
    padding named, in --json and in the printed summary; at 512 neither."""
    odd = ["--set", "model.config.vocab_size=513", "--set", "train.precision=bf16"]
    common = ["estimate", str(TINY), "--accelerator", "H100-80GB", "--strategy", "single", "--no-advice"]
    res = pilotrun_cli(*common, *odd, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    fit = json.loads(res.stdout)["fits"][0]
    u = fit["time"]["unaligned_matmuls"]
    assert u["dimensions"] == [{"size": 513, "padded": 576, "what": "features"}]
    assert "lm_head" in u["modules"]
    assert "a lower bound" in fit["utilisation_source"]
    text = pilotrun_cli(*common, *odd, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "time is a lower bound" in " ".join(text.stdout.split())
    assert "pad_to_multiple_of=64" in " ".join(text.stdout.split())
    aligned = pilotrun_cli(*common, "--set", "train.precision=bf16", "--json", cwd=tmp_path)
    assert "unaligned_matmuls" not in json.loads(aligned.stdout)["fits"][0]["time"]


def test_a_row_with_no_time_calls_nothing_a_lower_bound(tmp_path):
    """Offload without the host link in the catalog has no time: the unaligned matmuls are not reported as bounding
    a time that is not there."""
    from pilotrun.estimate.catalog import load_catalog
    from pilotrun.estimate.model import estimate_fit
    from tests.estimate.test_estimate import synthetic_trace
    from tests.estimate.test_estimate_time import _with_ops

    trace = _with_ops(synthetic_trace(), micro=[["bf16", int(1e14), int(1e9), 10]], step=[["fp32", 0, int(5e10), 1]])
    trace["stages"]["steady_step"]["unaligned_matmuls"] = [["bf16", 4096, 50257, 768, int(5e14), 1, [50257],
                                                            ["lm_head"]]]
    h100 = load_catalog()["H100-80GB"]
    timed = estimate_fit(trace, h100, "fsdp", 2)
    assert timed["time"]["unaligned_matmuls"]["dimensions"] == [{"size": 50257, "padded": 50304, "what": "features"}]
    no_link = tmp_path / "cat.yaml"
    no_link.write_text("accelerators:\n  H100-80GB:\n    host: {link_gb_s: null}\n")
    untimed = estimate_fit({**trace, "offload": "cpu"}, load_catalog(no_link)["H100-80GB"], "fsdp", 2)
    assert untimed["seconds_per_update"] is None and "unaligned_matmuls" not in untimed["time"]
