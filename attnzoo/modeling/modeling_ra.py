"""The RA family: the shared backbone and heads with randomized attention."""

from attnzoo.configuration.ra import ZooRAConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooRAPreTrainedModel",
    "ZooRAModel",
    "ZooRAForCausalLM",
    "ZooRAForMaskedLM",
    "ZooRAForSequenceClassification",
    "ZooRAForImageClassification",
    "ZooRAForConditionalGeneration",
]


class ZooRAPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooRAConfig


class ZooRAModel(ZooRAPreTrainedModel, ZooModel):
    pass


class ZooRAForCausalLM(ZooRAPreTrainedModel, ZooForCausalLM):
    pass


class ZooRAForMaskedLM(ZooRAPreTrainedModel, ZooForMaskedLM):
    pass


class ZooRAForSequenceClassification(ZooRAPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooRAForImageClassification(ZooRAPreTrainedModel, ZooForImageClassification):
    pass


class ZooRAForConditionalGeneration(ZooRAPreTrainedModel, ZooForConditionalGeneration):
    pass
