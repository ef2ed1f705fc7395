"""What every worker does first: rebuild the spec, the data, the model and the trainer from files."""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch

from ..config.spec import Spec, spec_from_mapping
from ..data.bundle import build_data
from ..devices import pick_device
from ..models.loading import build_model, load_tokenizer
from ..train.loop import Trainer, seed_everything


def write_spec_file(spec: Spec, path: Path) -> Path:
    """What a worker needs to rebuild exactly this spec: the mapping as written (overrides included)."""
    path.write_text(json.dumps({"source": spec.source, "written": spec.written}))
    return path


def read_spec_file(path: str | Path) -> Spec:
    payload = json.loads(Path(path).read_text())
    return spec_from_mapping(payload["written"], payload["source"])


def build_trainer(spec: Spec) -> tuple[Trainer, object, torch.device]:
    """The same objects, in the same order and with the same seeds, as the pilot's own process builds
    (under torchrun: the same process group, device per LOCAL_RANK and wrapper)."""
    from .. import distributed

    logging.getLogger("transformers").setLevel(logging.ERROR)
    device, _ = pick_device(spec.train.device)
    env = distributed.init(spec.distributed.strategy, device.type)
    if env.active and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    seed_everything(spec.seed)
    tokenizer = load_tokenizer(spec) if spec.data.task is not None else None
    data = build_data(spec, tokenizer)
    loaded = build_model(spec, data.label_names, tokenizer)
    model = loaded.model.to(device)
    ratio = distributed.reduction_ratio(env, device)
    wrapped, _ = distributed.wrap(model, env, device)
    trainer = Trainer(wrapped, data.train, data.collate, spec, device, pad_batch=data.pad_batch, env=env,
                      reduction_ratio=ratio)
    trainer.probe_policy()  # the same decision, by the same probe, as the pilot's own process
    return trainer, data, device


def peak_memory(device: torch.device) -> dict:
    """This process's peaks, for the gate row (children report their own memory)."""
    mem = {"host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)}
    if device.type == "cuda":
        mem["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        mem["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return mem


def write_result(path: str | Path, payload: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, path)
