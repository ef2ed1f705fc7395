"""NVIDIA CUDA and AMD ROCm: two runtimes torch drives through the same ``torch.cuda`` module.

A ROCm build of torch names its devices ``cuda`` and answers every ``torch.cuda`` call through HIP; only
``torch.version.hip`` (:func:`hip_version`, the one place that reads it) tells them apart. So ROCm is CUDA
with its own name, visibility variable and label.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .base import Backend, Reading, Version, Visible

# Checkpoint keys of the per-device generators: "cuda_0", "cuda_1", ... Checkpoints written on ROCm have these
# keys too (its torch is torch.cuda), so a checkpoint moves between the two.
RNG_PREFIX = "cuda_"


def hip_version() -> str | None:
    """The HIP version this torch was built with; None on a CUDA or CPU-only build."""
    return getattr(torch.version, "hip", None)


class CUDA(Backend):
    name = "cuda"
    label = "CUDA"
    device_type = "cuda"
    indexed = True
    allocator_counts = True
    pin_memory = True
    dist_backend = "nccl"  # ROCm's torch calls RCCL "nccl" too
    # CUDA C Programming Guide, "CUDA Environment Variables".
    visible_var = "CUDA_VISIBLE_DEVICES"
    inherited_visible: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)
    oom_words = ("cuda",)

    def built(self) -> bool:
        return hip_version() is None

    def available(self) -> bool:
        return self.built() and torch.cuda.is_available()

    def visible(self) -> Visible:
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return Visible(names=tuple(p.name for p in props), total_memory_bytes=tuple(int(p.total_memory) for p in props),
                       versions={"cuda": torch.version.cuda, "hip": hip_version()})

    def unavailable(self, requested: str) -> str:
        # Both runtimes answer a cuda device: the message names both.
        return f"train.device is {requested!r} but no CUDA/ROCm device is visible (use cpu or auto)"

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def reset_peaks(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated(self, device: torch.device) -> Reading:
        return Reading(int(torch.cuda.max_memory_allocated(device)))

    def peak_reserved(self, device: torch.device) -> Reading:
        return Reading(int(torch.cuda.max_memory_reserved(device)))

    def alloc_retries(self, device: torch.device) -> Reading:
        return Reading(int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)))

    def device_used(self, device: torch.device) -> Reading:
        free, total = torch.cuda.mem_get_info(device)
        return Reading(int(total - free))

    def total_memory(self, device: torch.device) -> int:
        return int(torch.cuda.get_device_properties(device).total_memory)

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {f"{RNG_PREFIX}{i}": st for i, st in enumerate(torch.cuda.get_rng_state_all())}

    def set_rng_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for key, st in tensors.items():
            if key.startswith(RNG_PREFIX):
                torch.cuda.set_rng_state(st, int(key[len(RNG_PREFIX):]))

    def versions(self) -> dict[str, Version]:
        """The torch.cuda build's libraries, one set for CUDA and ROCm (on ROCm "cudnn" is MIOpen's version and
        "nccl" RCCL's, as torch reports them)."""
        out: dict[str, Version] = {"cuda": torch.version.cuda, "hip": hip_version(), "cudnn": None, "nccl": None}
        try:  # an int, as torch reports it (and as every lock written before has it)
            out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except Exception:
            pass
        if self.available():  # NCCL's version is only asked of a usable runtime
            try:
                v = torch.cuda.nccl.version()
                out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception:
                pass
        return out


class ROCm(CUDA):
    name = "rocm"
    label = "ROCm"
    # ROCm docs, "GPU isolation techniques". ROCm's torch also honours CUDA_VISIBLE_DEVICES, applied after HIP's,
    # so a ROCm worker gets HIP's and not an inherited CUDA one (which would select again among the selected).
    visible_var = "HIP_VISIBLE_DEVICES"
    inherited_visible = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    oom_words = ("hip",)

    def built(self) -> bool:
        return hip_version() is not None

    def launcher_ids(self, count: int, environ: Mapping[str, str]) -> tuple[list[str], str]:
        hip, cuda = environ.get("HIP_VISIBLE_DEVICES"), environ.get("CUDA_VISIBLE_DEVICES")
        if hip and cuda:  # CUDA's list selects among HIP's: compose them
            hip_ids = [p.strip() for p in hip.split(",") if p.strip()]
            picks = [p.strip() for p in cuda.split(",") if p.strip()]
            if all(p.isdigit() and int(p) < len(hip_ids) for p in picks) and len(picks) >= count:
                return ([hip_ids[int(p)] for p in picks[:count]],
                        f"$HIP_VISIBLE_DEVICES={hip} then $CUDA_VISIBLE_DEVICES={cuda}")
        return super().launcher_ids(count, environ)

    def worker_env(self, environ: Mapping[str, str], ids: list[str] | tuple[str, ...]) -> dict[str, str]:
        env = super().worker_env(environ, ids)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # HIP's selection alone: an inherited CUDA one would select again
        return env
