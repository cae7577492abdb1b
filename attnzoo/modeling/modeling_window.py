"""The window family: the shared backbone and heads with sliding-window-with-sinks attention."""

from attnzoo.configuration.window import ZooWindowConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooWindowPreTrainedModel",
    "ZooWindowModel",
    "ZooWindowForCausalLM",
    "ZooWindowForMaskedLM",
    "ZooWindowForSequenceClassification",
    "ZooWindowForImageClassification",
    "ZooWindowForConditionalGeneration",
]


class ZooWindowPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooWindowConfig
    # The decoding state is a ring of the last tokens, which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooWindowModel(ZooWindowPreTrainedModel, ZooModel):
    pass


class ZooWindowForCausalLM(ZooWindowPreTrainedModel, ZooForCausalLM):
    pass


class ZooWindowForMaskedLM(ZooWindowPreTrainedModel, ZooForMaskedLM):
    pass


class ZooWindowForSequenceClassification(ZooWindowPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooWindowForImageClassification(ZooWindowPreTrainedModel, ZooForImageClassification):
    pass


class ZooWindowForConditionalGeneration(ZooWindowPreTrainedModel, ZooForConditionalGeneration):
    pass
