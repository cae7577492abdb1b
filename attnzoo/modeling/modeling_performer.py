"""The Performer family: the shared backbone and heads with FAVOR+ (or elu+1) attention."""

from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.modeling import heads

__all__ = [
    "ZooPerformerPreTrainedModel",
    "ZooPerformerModel",
    "ZooPerformerForCausalLM",
    "ZooPerformerForMaskedLM",
    "ZooPerformerForSequenceClassification",
    "ZooPerformerForImageClassification",
    "ZooPerformerForConditionalGeneration",
]


class ZooPerformerPreTrainedModel(heads.ZooPreTrainedModel):
    config_class = ZooPerformerConfig
    # Decoding state is a recurrent (S, z), which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooPerformerModel(ZooPerformerPreTrainedModel, heads.ZooModel):
    pass


class ZooPerformerForCausalLM(ZooPerformerPreTrainedModel, heads.ZooForCausalLM):
    pass


class ZooPerformerForMaskedLM(ZooPerformerPreTrainedModel, heads.ZooForMaskedLM):
    pass


class ZooPerformerForSequenceClassification(ZooPerformerPreTrainedModel, heads.ZooForSequenceClassification):
    pass


class ZooPerformerForImageClassification(ZooPerformerPreTrainedModel, heads.ZooForImageClassification):
    pass


class ZooPerformerForConditionalGeneration(ZooPerformerPreTrainedModel, heads.ZooForConditionalGeneration):
    pass
