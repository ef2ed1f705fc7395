"""Models and tokenizers named by a spec."""
from .loading import LoadedModel, ModelError, build_model, load_tokenizer, parameter_count

__all__ = ["LoadedModel", "ModelError", "build_model", "load_tokenizer", "parameter_count"]
