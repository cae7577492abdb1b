"""The softmax baseline family: the shared backbone and heads with exact attention."""

from attnzoo.configuration.softmax import ZooSoftmaxConfig
from attnzoo.modeling import heads

__all__ = [
    "ZooSoftmaxPreTrainedModel",
    "ZooSoftmaxModel",
    "ZooSoftmaxForCausalLM",
    "ZooSoftmaxForMaskedLM",
    "ZooSoftmaxForSequenceClassification",
    "ZooSoftmaxForImageClassification",
    "ZooSoftmaxForConditionalGeneration",
]


class ZooSoftmaxPreTrainedModel(heads.ZooPreTrainedModel):
    config_class = ZooSoftmaxConfig


class ZooSoftmaxModel(ZooSoftmaxPreTrainedModel, heads.ZooModel):
    pass


class ZooSoftmaxForCausalLM(ZooSoftmaxPreTrainedModel, heads.ZooForCausalLM):
    pass


class ZooSoftmaxForMaskedLM(ZooSoftmaxPreTrainedModel, heads.ZooForMaskedLM):
    pass


class ZooSoftmaxForSequenceClassification(ZooSoftmaxPreTrainedModel, heads.ZooForSequenceClassification):
    pass


class ZooSoftmaxForImageClassification(ZooSoftmaxPreTrainedModel, heads.ZooForImageClassification):
    pass


class ZooSoftmaxForConditionalGeneration(ZooSoftmaxPreTrainedModel, heads.ZooForConditionalGeneration):
    pass
