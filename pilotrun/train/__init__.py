"""The training loop the gates drive."""
from .loop import LossPolicy, NonFiniteError, Trainer, UpdateRecord, decide_loss_policy, seed_everything

__all__ = ["LossPolicy", "NonFiniteError", "Trainer", "UpdateRecord", "decide_loss_policy", "seed_everything"]
