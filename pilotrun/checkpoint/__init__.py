"""Checkpoints and exports: atomic, hashed, loadable without pickle."""
from .export import export_model, safetensors_tensor_count
from .io import AtomicFolder, CheckpointError, latest_checkpoint, read_manifest, verify_folder
from .state import (
    capture_rng,
    check_trusted,
    compare_fingerprints,
    fingerprint_state,
    load_torch_file,
    manifest_sha256,
    restore_rng,
    restore_training_state,
    save_checkpoint,
)

__all__ = ["AtomicFolder", "CheckpointError", "latest_checkpoint", "capture_rng", "export_model", "read_manifest",
           "restore_rng", "safetensors_tensor_count", "save_checkpoint", "verify_folder", "check_trusted",
           "compare_fingerprints", "fingerprint_state", "load_torch_file", "manifest_sha256", "restore_training_state"]
