"""An objective written outside cat_fast, registered through the ``cat_fast.objectives`` entry-point group
(tests/plugin/test_plugin.py installs it with a ``*.dist-info`` folder on the path): the model's own loss scaled
by ``ce_scale``. Its config gives ``cat-fast train --method scaled-ce`` the flag ``--ce-scale``."""
from dataclasses import dataclass

from cat_fast.models import model_inputs
from cat_fast.objectives import Curve, Objective, ObjectiveConfig, option
from cat_fast.objectives.base import check_number


@dataclass
class ScaledConfig(ObjectiveConfig):
    title = "scaled-ce (plugin)"
    ce_scale: float = option(1.0, low=0.0, low_open=True, help="the factor of the model's loss")


class ScaledCE(Objective):
    """The model's own loss times ce_scale (a plugin example)."""

    config = ScaledConfig
    curves = (Curve("scaled_loss", "scaled loss"),)
    registry = {"data": "orig"}  # `cat_fast.objectives.register`'s keywords

    def __init__(self, model, ce_scale=1.0):
        super().__init__(model)
        self.ce_scale = check_number("ce_scale", ce_scale, low=0.0, low_open=True)

    def capture_key(self, batch, *args):
        return ()

    def __call__(self, batch):
        self.step += 1
        loss = self.plain_forward({**model_inputs(batch), "labels": batch["labels"]}).loss * self.ce_scale
        return loss, {"scaled_loss": loss.detach()}
