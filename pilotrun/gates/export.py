"""``export``: the inference artifact (safetensors + config, or + export.json for factory models)."""
from __future__ import annotations

from ..checkpoint.export import export_model, safetensors_tensor_count
from ..ui.format import human_bytes
from .base import Gate, GateFailure, Outcome, on_main_rank


class ExportGate(Gate):
    name = "export"
    depends_on = ("load",)

    def run(self, ctx, meter) -> Outcome:
        state_dict = None
        if ctx.env is not None and ctx.env.active:
            # Every rank takes part in gathering the full weights; rank 0 alone receives and writes them.
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(ctx.trainer.model,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return on_main_rank(ctx, self, lambda: self._export(ctx, state_dict))

    def _export(self, ctx, state_dict) -> Outcome:
        spec = ctx.spec
        folder = ctx.out_dir / "export"
        written = export_model(
            folder, ctx.model, tokenizer=ctx.tokenizer,
            factory=spec.model.factory, model_mapping=spec.model_mapping() if spec.model.factory else None,
            spec_folder=str(spec.folder), state_dict=state_dict,
        )
        ctx.export_dir = folder
        n_tensors = safetensors_tensor_count(folder)
        if n_tensors == 0:
            raise GateFailure(f"the export in {folder} holds no tensors")
        weights = {k: v for k, v in written.files.items() if k.endswith(".safetensors")}
        out = Outcome(inputs={"precision": spec.train.precision, "rank": ctx.rank, "world_size": ctx.world_size})
        out.details = {"path": str(folder), "files": written.files, "bytes": written.total_bytes, "tensors": n_tensors}
        trained = ctx.trainer.step if ctx.trainer is not None else 0
        state = f"after {trained} update(s)" if trained else "as loaded (no update succeeded)"
        out.reason = (f"{n_tensors} tensors in {len(weights)} safetensors file(s), {human_bytes(written.total_bytes)} "
                      f"in all, to {folder.name}/ with a sha256 manifest; the model {state}")
        return out
