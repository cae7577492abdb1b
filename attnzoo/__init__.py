"""attnzoo: efficient-attention Transformers (Reformer, Performer, RA, LARA, and a softmax baseline) as Hugging Face
models. Importing the package registers every family with transformers' Auto classes."""

from attnzoo.configuration import ZooConfig, ZooReformerConfig, ZooSoftmaxConfig
from attnzoo.modeling import (
    ATTENTION_REGISTRY,
    ZooAttention,
    ZooCache,
    modeling_reformer,
    modeling_softmax,
    register_attention,
)
from attnzoo.modeling.modeling_reformer import (
    ZooReformerForCausalLM,
    ZooReformerForConditionalGeneration,
    ZooReformerForImageClassification,
    ZooReformerForMaskedLM,
    ZooReformerForSequenceClassification,
    ZooReformerModel,
    ZooReformerPreTrainedModel,
)
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
register_family(ZooReformerConfig, modeling_reformer, "ZooReformer")

__all__ = [
    "ATTENTION_REGISTRY",
    "ZooAttention",
    "ZooCache",
    "ZooConfig",
    "ZooReformerConfig",
    "ZooReformerForCausalLM",
    "ZooReformerForConditionalGeneration",
    "ZooReformerForImageClassification",
    "ZooReformerForMaskedLM",
    "ZooReformerForSequenceClassification",
    "ZooReformerModel",
    "ZooReformerPreTrainedModel",
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
