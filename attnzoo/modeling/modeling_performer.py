"""The Performer family: the shared backbone and heads with FAVOR+ (or elu+1) attention."""

from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooPerformerPreTrainedModel",
    "ZooPerformerModel",
    "ZooPerformerForCausalLM",
    "ZooPerformerForMaskedLM",
    "ZooPerformerForSequenceClassification",
    "ZooPerformerForImageClassification",
    "ZooPerformerForConditionalGeneration",
]


class ZooPerformerPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooPerformerConfig
    # Decoding state is a recurrent (S, z), which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooPerformerModel(ZooPerformerPreTrainedModel, ZooModel):
    pass


class ZooPerformerForCausalLM(ZooPerformerPreTrainedModel, ZooForCausalLM):
    pass


class ZooPerformerForMaskedLM(ZooPerformerPreTrainedModel, ZooForMaskedLM):
    pass


class ZooPerformerForSequenceClassification(ZooPerformerPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooPerformerForImageClassification(ZooPerformerPreTrainedModel, ZooForImageClassification):
    pass


class ZooPerformerForConditionalGeneration(ZooPerformerPreTrainedModel, ZooForConditionalGeneration):
    pass
