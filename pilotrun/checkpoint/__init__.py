"""Checkpoints and exports: atomic, hashed, loadable without pickle."""
from .export import export_model, safetensors_tensor_count
from .io import AtomicFolder, CheckpointError, latest_checkpoint, read_manifest, verify_folder
from .state import capture_rng, restore_rng, save_checkpoint

__all__ = ["AtomicFolder", "CheckpointError", "latest_checkpoint", "capture_rng", "export_model", "read_manifest", "restore_rng",
           "safetensors_tensor_count", "save_checkpoint", "verify_folder"]
