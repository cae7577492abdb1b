"""The Reformer family ("Reformer: The Efficient Transformer", arXiv 2001.04451): the shared backbone and heads with
LSH and local attention, reversible layers, chunked feed-forward and axial positions, as set by
`ZooReformerConfig`."""

from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooReformerPreTrainedModel",
    "ZooReformerModel",
    "ZooReformerForCausalLM",
    "ZooReformerForMaskedLM",
    "ZooReformerForSequenceClassification",
    "ZooReformerForImageClassification",
    "ZooReformerForConditionalGeneration",
]


class ZooReformerPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooReformerConfig


class ZooReformerModel(ZooReformerPreTrainedModel, ZooModel):
    pass


class ZooReformerForCausalLM(ZooReformerPreTrainedModel, ZooForCausalLM):
    pass


class ZooReformerForMaskedLM(ZooReformerPreTrainedModel, ZooForMaskedLM):
    pass


class ZooReformerForSequenceClassification(ZooReformerPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooReformerForImageClassification(ZooReformerPreTrainedModel, ZooForImageClassification):
    pass


class ZooReformerForConditionalGeneration(ZooReformerPreTrainedModel, ZooForConditionalGeneration):
    pass
