"""reload_eval's comparison when the job's model computes with 2-byte copies of fp32 weights (FSDP2's
MixedPrecisionPolicy): exact where the reload runs the job's own kernels (the CPU), on the outputs' scale from a GPU,
and an export of the copies instead of the masters refused whatever the outputs say. Pure: a view of the test's own
stands in for the job."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pilotrun.gates.base import GateFailure
from pilotrun.gates.reload_eval import GATHERED_SCALE_TOL, compare_reload
from pilotrun.gates.view import Artifact, Reloaded


class _View:
    reference_note = "FSDP2 computes with its parameters gathered in bf16"
    reference_dtype = torch.bfloat16

    def __init__(self, device: str, reloaded: Reloaded) -> None:
        self.reference_device = device
        self._reloaded = reloaded

    def reload_problem(self, artifact):
        return None

    def reload(self, artifact, batch, work):
        return self._reloaded

    def export_state(self):
        return None  # as under FSDP: the live weights are shards, not named as the export's


FIRST = torch.tensor([[1.5, -2.0, 0.25], [3.0, 0.5, -1.0]])


def _compare(device: str, shift: float, stored=("float32",), masters=("float32",), tmp: Path = Path(".")):
    reloaded = Reloaded(FIRST + shift, "LlamaForCausalLM", "LlamaForCausalLM", None, stored, masters)
    return compare_reload(_View(device, reloaded), Artifact(tmp, "0" * 64), [{"id": "a"}, {"id": "b"}], None,
                          FIRST, FIRST.clone(), tmp)


def test_on_the_cpu_the_usual_tolerance_holds(tmp_path):
    assert "max difference 0" in _compare("cpu", 0.0, tmp=tmp_path).reason
    with pytest.raises(GateFailure, match=r"rtol 0.0001, atol 1e-05"):
        _compare("cpu", 1e-3, tmp=tmp_path)


def test_from_a_gpu_the_outputs_scale_at_bf16_rounding(tmp_path):
    out = _compare("cuda", 1e-2, tmp=tmp_path)  # bf16 rounding of outputs of scale 3
    assert out.details["tolerance"] == {"output_scale_fraction": GATHERED_SCALE_TOL, "output_scale": 3.0}
    with pytest.raises(GateFailure, match=r"0.02 x the output scale 3"):
        _compare("cuda", 0.5, tmp=tmp_path)  # a wrong weight moves outputs by far more


def test_an_export_of_the_gathered_copies_is_refused_even_when_the_outputs_agree(tmp_path):
    with pytest.raises(GateFailure, match=r"stores its parameters in bfloat16 where training keeps them in float32"):
        _compare("cpu", 0.0, stored=("bfloat16",), tmp=tmp_path)
    assert _compare("cpu", 0.0, stored=("float32",), masters=None, tmp=tmp_path).verdict.value == "pass"
