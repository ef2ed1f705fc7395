"""The software stack a run depends on beyond the framework: compiled extensions and kernels.

On ROCm these are verified as one set — custom extensions, kernels and package
versions — never "supported" because PyTorch itself is.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

# Packages that ship compiled kernels, with what the reference says about them on ROCm.
EXTENSIONS = {
    "flash-attn": "ROCm: CK backend (FA2 only; forward head dim <= 256, backward <= 128) or Triton; no FA3",
    "xformers": "ROCm wheels: CK ops only; fa2/fa3 ops unavailable",
    "bitsandbytes": "ROCm: experimental through 0.48; 0.50 docs list AMD as supported",
    "apex": "ROCm: use the ROCm/apex fork",
    "deepspeed": "ROCm: fused_adam/cpu_adam JIT fine; sparse_attn incompatible; evoformer needs CUTLASS",
    "triton": "ROCm: upstream AMD backend; ROCm wheels ship pytorch-triton-rocm",
    "pytorch-triton-rocm": "the ROCm Triton build",
    "transformer-engine": "NVIDIA only (FP8 needs compute capability >= 8.9)",
    "torchao": "float8 needs H100+ and torch.compile; on MI300 FP8 is FNUZ (e4m3fnuz)",
    "liger-kernel": "Triton kernels: verify on the target",
}


def installed_extensions(spec_folder: Path | None = None) -> list[dict]:
    """Kernel packages in this environment and the user's own compiled files beside the spec."""
    out: list[dict] = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in EXTENSIONS:
            out.append({"name": name, "version": dist.version, "note": EXTENSIONS[name]})
    if spec_folder is not None and spec_folder.exists():
        for so in sorted(spec_folder.rglob("*.so"))[:50]:
            out.append({"name": str(so.relative_to(spec_folder)), "version": None,
                        "note": "your own compiled extension: rebuild and test it on the target"})
    return sorted(out, key=lambda x: x["name"])


def stack_status(acc, verified_by: str | None, extensions: list[dict]) -> dict:
    if acc.stack == "rocm":
        items = [f"{e['name']} {e['version'] or ''}".strip() for e in extensions]
        return {"verified": False if not verified_by else True,
                "text": ("verified by " + verified_by) if verified_by else
                ("not verified: torch (HIP build)" + (", " + ", ".join(items) if items else "")
                 + " and your kernels must be tested together on ROCm, as one set"),
                "to_verify": extensions}
    return {"verified": bool(verified_by),
            "text": f"verified by {verified_by}" if verified_by else "not verified: no pilot on this accelerator yet",
            "to_verify": [e for e in extensions if "NVIDIA" in e["note"] or "Triton" in e["note"]]}
