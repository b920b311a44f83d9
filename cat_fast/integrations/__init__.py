"""cat_fast inside other training frameworks: the Hugging Face `Trainer` classes (`trainer`, imports transformers)."""
from .trainer import CATTrainer, GSTrainer, NonFiniteLossError, ObjectiveTrainer, SingleGPUWarning, StepGraphsError

__all__ = ["ObjectiveTrainer", "CATTrainer", "GSTrainer", "NonFiniteLossError", "SingleGPUWarning", "StepGraphsError"]
