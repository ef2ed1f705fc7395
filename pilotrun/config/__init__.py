"""The spec: typed, validated once at the edge."""
from .schema import SpecError
from .spec import Spec, load_spec

__all__ = ["Spec", "SpecError", "load_spec"]
