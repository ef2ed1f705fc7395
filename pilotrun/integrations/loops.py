"""What the views of a hand-written loop share (``accelerate.begin``, ``fabric.begin``): the loop's own loss over a
window of micro batches, each divided by the window's length before backward (what ``accelerator.backward`` and a
Fabric loop's ``loss / accumulate`` do), the model's outputs on the CPU, and a ``save_pretrained`` export reloaded
with ``from_pretrained`` in a fresh process. A framework's view adds how it finds the model, its batching and how
it writes an export that is not a transformers model.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.export import safetensors_tensor_count
from ..checkpoint.io import AtomicFolder
from ..gates.view import Artifact, Exported, Reloaded, tensors_of
from ..train.batches import to_device
from ..train.evaluation import outputs_of
from ..train.loss import rng_untouched
from . import common as C
from .copying import own_copy


class HandLoopView(C.FrameworkView, abstract=True):
    """A :class:`~.common.FrameworkView` of a loop the user wrote: ``loss_fn(model, batch)`` is its loss."""

    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]

    def accumulate(self, model, micro: list, device) -> float:
        total = 0.0
        for _, batch in micro:
            loss = self.loss_fn(model, to_device(batch, device)) / len(micro)  # the loop's division by the window
            loss.backward()
            total += float(loss.detach())
        return total

    def one_batch(self, model, batch, device) -> float:
        loss = self.loss_fn(model, to_device(batch, device))
        loss.backward()
        return float(loss.detach())

    def export_with(self, folder: Path, written_by: str, other: Callable[[Path], None], how_other: str) -> Exported:
        """``save_pretrained`` of the model when it has one, else ``other(tmp_folder)`` (``how_other`` says what);
        written atomically with a manifest (its digest of the bytes written)."""
        model = self.model
        how = "save_pretrained" if hasattr(model, "save_pretrained") else how_other
        with AtomicFolder(folder, "export", {"written_by": f"{written_by}: {how}"}) as out:
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(str(out.tmp), safe_serialization=True)  # type: ignore[operator]
            else:
                other(out.tmp)
            out.adopt_existing()
        weights = sorted(f for f in out.files if f.endswith(".safetensors"))
        return Exported(folder, out.files, out.total_bytes, str(out.manifest_sha256), weights,
                        tensors=safetensors_tensor_count(folder) if weights else None, written_by=how)

    def outputs(self, batch) -> torch.Tensor:
        model = self.model
        if next(model.parameters()).device.type != "cpu":
            model = own_copy(model).to("cpu")  # the reload runs on the CPU
        was = model.training
        try:
            with rng_untouched():
                return outputs_of(model, tensors_of(batch))
        finally:
            model.train(was)  # the live model (on the CPU): the run goes on training with dropout

    def export_state(self) -> dict[str, torch.Tensor] | None:
        from ..gates.reload_eval import export_state_of

        return export_state_of(self.model)

    def reload_problem(self, artifact: Artifact) -> str | None:
        if (artifact.folder / "config.json").is_file():
            return None
        return (f"not measured: the export has no config.json ({type(self.model).__name__} is not a transformers "
                "PreTrainedModel), so from_pretrained cannot rebuild it in a fresh process")

    def reload(self, artifact: Artifact, batch, work: Path) -> Reloaded:
        return C.reload_pretrained(artifact, batch, work)
