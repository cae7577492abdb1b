"""The LARA family: the shared backbone and heads with linear randomized attention (causal LARA in decoders)."""

from attnzoo.configuration.lara import ZooLARAConfig
from attnzoo.modeling.base_models import ZooModel, ZooPreTrainedModel
from attnzoo.modeling.heads import (
    ZooForCausalLM,
    ZooForConditionalGeneration,
    ZooForImageClassification,
    ZooForMaskedLM,
    ZooForSequenceClassification,
)

__all__ = [
    "ZooLARAPreTrainedModel",
    "ZooLARAModel",
    "ZooLARAForCausalLM",
    "ZooLARAForMaskedLM",
    "ZooLARAForSequenceClassification",
    "ZooLARAForImageClassification",
    "ZooLARAForConditionalGeneration",
]


class ZooLARAPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLARAConfig
    # Causal LARA decodes from a recurrent state, which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooLARAModel(ZooLARAPreTrainedModel, ZooModel):
    pass


class ZooLARAForCausalLM(ZooLARAPreTrainedModel, ZooForCausalLM):
    pass


class ZooLARAForMaskedLM(ZooLARAPreTrainedModel, ZooForMaskedLM):
    pass


class ZooLARAForSequenceClassification(ZooLARAPreTrainedModel, ZooForSequenceClassification):
    pass


class ZooLARAForImageClassification(ZooLARAPreTrainedModel, ZooForImageClassification):
    pass


class ZooLARAForConditionalGeneration(ZooLARAPreTrainedModel, ZooForConditionalGeneration):
    pass
