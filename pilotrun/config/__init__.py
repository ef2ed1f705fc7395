"""The spec: typed, validated once at the edge."""
from .load import load_spec
from .schema import SpecError
from .spec import Spec

__all__ = ["Spec", "SpecError", "load_spec"]
