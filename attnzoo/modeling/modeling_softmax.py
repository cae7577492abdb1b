"""The softmax baseline family: the shared backbone and heads with exact attention."""

from attnzoo.configuration.softmax import ZooSoftmaxConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooSoftmaxPreTrainedModel",
    "ZooSoftmaxModel",
    "ZooSoftmaxForCausalLM",
    "ZooSoftmaxForMaskedLM",
    "ZooSoftmaxForSequenceClassification",
    "ZooSoftmaxForImageClassification",
    "ZooSoftmaxForConditionalGeneration",
]


class ZooSoftmaxPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooSoftmaxConfig


class ZooSoftmaxModel(ZooSoftmaxPreTrainedModel, ZooModel):
    pass


class ZooSoftmaxForCausalLM(ZooSoftmaxPreTrainedModel, ZooForCausalLM):
    pass


class ZooSoftmaxForMaskedLM(ZooSoftmaxPreTrainedModel, ZooForMaskedLM):
    pass


class ZooSoftmaxForSequenceClassification(ZooSoftmaxPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooSoftmaxForImageClassification(ZooSoftmaxPreTrainedModel, ZooForImageClassification):
    pass


class ZooSoftmaxForConditionalGeneration(ZooSoftmaxPreTrainedModel, ZooForConditionalGeneration):
    pass
