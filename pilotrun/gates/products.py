"""What gates leave for later gates: the products a gate declares it needs, uses or produces."""
from __future__ import annotations

from enum import Enum


class Product(str, Enum):
    """What gates leave for later gates (held by :class:`~pilotrun.gates.context.PilotContext`)."""

    DATA = "data"                  # tokenizer and datasets: built on first use by the context, not by a gate
    LOCK = "lock"                  # lock: revisions, versions, config and seeds
    SCAN = "scan"                  # inspect: counts over the training split
    DRIVER = "driver"              # load: the model on its device, wrapped, with optimizer and data order
    FIRST_UPDATE = "first-update"  # first_step: one update applied, the optimizer state allocated
    CHECKPOINT = "checkpoint"      # save: the full training state on disk with its fingerprints
    EXPORT = "export"              # export: the inference artifact on disk


# Products no gate makes: the context provides them on demand.
CONTEXT_PRODUCTS = frozenset({Product.DATA})
