"""The RA family: the shared backbone and heads with randomized attention."""

from attnzoo.configuration.ra import ZooRAConfig
from attnzoo.modeling import heads

__all__ = [
    "ZooRAPreTrainedModel",
    "ZooRAModel",
    "ZooRAForCausalLM",
    "ZooRAForMaskedLM",
    "ZooRAForSequenceClassification",
    "ZooRAForImageClassification",
    "ZooRAForConditionalGeneration",
]


class ZooRAPreTrainedModel(heads.ZooPreTrainedModel):
    config_class = ZooRAConfig


class ZooRAModel(ZooRAPreTrainedModel, heads.ZooModel):
    pass


class ZooRAForCausalLM(ZooRAPreTrainedModel, heads.ZooForCausalLM):
    pass


class ZooRAForMaskedLM(ZooRAPreTrainedModel, heads.ZooForMaskedLM):
    pass


class ZooRAForSequenceClassification(ZooRAPreTrainedModel, heads.ZooForSequenceClassification):
    pass


class ZooRAForImageClassification(ZooRAPreTrainedModel, heads.ZooForImageClassification):
    pass


class ZooRAForConditionalGeneration(ZooRAPreTrainedModel, heads.ZooForConditionalGeneration):
    pass
