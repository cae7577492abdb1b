"""attnzoo: efficient-attention Transformers (Reformer, Performer, RA, LARA, and a softmax baseline) as Hugging Face
models. Importing the package registers every family with transformers' Auto classes."""

from attnzoo.configuration import ZooConfig, ZooSoftmaxConfig
from attnzoo.modeling import ATTENTION_REGISTRY, ZooAttention, ZooCache, modeling_softmax, register_attention
from attnzoo.modeling.modeling_softmax import (
    ZooSoftmaxForCausalLM,
    ZooSoftmaxForConditionalGeneration,
    ZooSoftmaxForImageClassification,
    ZooSoftmaxForMaskedLM,
    ZooSoftmaxForSequenceClassification,
    ZooSoftmaxModel,
    ZooSoftmaxPreTrainedModel,
)
from attnzoo.registration import register_family

__version__ = "0.1.0"

register_family(ZooSoftmaxConfig, modeling_softmax, "ZooSoftmax")

__all__ = [
    "ATTENTION_REGISTRY",
    "ZooAttention",
    "ZooCache",
    "ZooConfig",
    "ZooSoftmaxConfig",
    "ZooSoftmaxForCausalLM",
    "ZooSoftmaxForConditionalGeneration",
    "ZooSoftmaxForImageClassification",
    "ZooSoftmaxForMaskedLM",
    "ZooSoftmaxForSequenceClassification",
    "ZooSoftmaxModel",
    "ZooSoftmaxPreTrainedModel",
    "register_attention",
]
