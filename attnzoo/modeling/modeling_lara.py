"""The LARA family: the shared backbone and heads with linear randomized attention (causal LARA in decoders)."""

from attnzoo.configuration.lara import ZooLARAConfig
from attnzoo.modeling import heads

__all__ = [
    "ZooLARAPreTrainedModel",
    "ZooLARAModel",
    "ZooLARAForCausalLM",
    "ZooLARAForMaskedLM",
    "ZooLARAForSequenceClassification",
    "ZooLARAForImageClassification",
    "ZooLARAForConditionalGeneration",
]


class ZooLARAPreTrainedModel(heads.ZooPreTrainedModel):
    config_class = ZooLARAConfig
    # Causal LARA decodes from a recurrent state, which cannot be cropped: no assisted decoding.
    _is_stateful = True


class ZooLARAModel(ZooLARAPreTrainedModel, heads.ZooModel):
    pass


class ZooLARAForCausalLM(ZooLARAPreTrainedModel, heads.ZooForCausalLM):
    pass


class ZooLARAForMaskedLM(ZooLARAPreTrainedModel, heads.ZooForMaskedLM):
    pass


class ZooLARAForSequenceClassification(ZooLARAPreTrainedModel, heads.ZooForSequenceClassification):
    pass


class ZooLARAForImageClassification(ZooLARAPreTrainedModel, heads.ZooForImageClassification):
    pass


class ZooLARAForConditionalGeneration(ZooLARAPreTrainedModel, heads.ZooForConditionalGeneration):
    pass
