"""Hybrid stacks: the shared backbone and heads with a different attention kind per layer, from any family."""

from attnzoo.configuration.hybrid import ZooHybridConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooHybridPreTrainedModel",
    "ZooHybridModel",
    "ZooHybridForCausalLM",
    "ZooHybridForMaskedLM",
    "ZooHybridForSequenceClassification",
    "ZooHybridForImageClassification",
    "ZooHybridForConditionalGeneration",
]


class ZooHybridPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooHybridConfig
    # Layers may keep recurrent states (FAVOR+, LARA), which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooHybridModel(ZooHybridPreTrainedModel, ZooModel):
    pass


class ZooHybridForCausalLM(ZooHybridPreTrainedModel, ZooForCausalLM):
    pass


class ZooHybridForMaskedLM(ZooHybridPreTrainedModel, ZooForMaskedLM):
    pass


class ZooHybridForSequenceClassification(ZooHybridPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooHybridForImageClassification(ZooHybridPreTrainedModel, ZooForImageClassification):
    pass


class ZooHybridForConditionalGeneration(ZooHybridPreTrainedModel, ZooForConditionalGeneration):
    pass
