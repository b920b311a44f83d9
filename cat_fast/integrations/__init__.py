"""cat_fast inside other training frameworks: the Hugging Face `Trainer` classes (`trainer`, imports transformers)."""
from .trainer import CATTrainer, GSTrainer, NonFiniteLossError, ObjectiveTrainer, StepGraphsError

__all__ = ["ObjectiveTrainer", "CATTrainer", "GSTrainer", "NonFiniteLossError", "StepGraphsError"]
