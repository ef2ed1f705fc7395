"""Checkpoints and exports: atomic, hashed, loaded only through one policy (:mod:`.trust`), without pickle."""
from .export import export_model, safetensors_tensor_count
from .io import AtomicFolder, CheckpointError, folder_problems, latest_checkpoint, read_manifest, verify_folder
from .pinned import pinned, require_known
from .saving import PendingSave, save_checkpoint, start_checkpoint
from .state import (
    capture_rng,
    compare_fingerprints,
    fingerprint_state,
    load_torch_file,
    restore_rng,
    restore_training_state,
)
from .trust import Admission, LoadPolicy, LoadRefused, Refusal, known_manifests, manifest_sha256

__all__ = ["AtomicFolder", "CheckpointError", "latest_checkpoint", "capture_rng", "export_model", "read_manifest",
           "restore_rng", "safetensors_tensor_count", "save_checkpoint", "start_checkpoint", "PendingSave",
           "verify_folder", "compare_fingerprints", "fingerprint_state", "load_torch_file", "manifest_sha256",
           "restore_training_state", "folder_problems", "Admission", "LoadPolicy", "LoadRefused", "Refusal",
           "known_manifests", "require_known", "pinned"]
