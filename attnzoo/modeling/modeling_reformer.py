"""The Reformer family (seed 001): the shared backbone and heads with LSH and local attention, reversible layers,
chunked feed-forward and axial positions, as set by `ZooReformerConfig`."""

from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.modeling import heads

__all__ = [
    "ZooReformerPreTrainedModel",
    "ZooReformerModel",
    "ZooReformerForCausalLM",
    "ZooReformerForMaskedLM",
    "ZooReformerForSequenceClassification",
    "ZooReformerForImageClassification",
    "ZooReformerForConditionalGeneration",
]


class ZooReformerPreTrainedModel(heads.ZooPreTrainedModel):
    config_class = ZooReformerConfig


class ZooReformerModel(ZooReformerPreTrainedModel, heads.ZooModel):
    pass


class ZooReformerForCausalLM(ZooReformerPreTrainedModel, heads.ZooForCausalLM):
    pass


class ZooReformerForMaskedLM(ZooReformerPreTrainedModel, heads.ZooForMaskedLM):
    pass


class ZooReformerForSequenceClassification(ZooReformerPreTrainedModel, heads.ZooForSequenceClassification):
    pass


class ZooReformerForImageClassification(ZooReformerPreTrainedModel, heads.ZooForImageClassification):
    pass


class ZooReformerForConditionalGeneration(ZooReformerPreTrainedModel, heads.ZooForConditionalGeneration):
    pass
