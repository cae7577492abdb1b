"""attnzoo: efficient-attention Transformers (Reformer, Performer, RA, LARA, and a softmax baseline) as Hugging Face
models. Importing the package registers every family with transformers' Auto classes."""

from attnzoo.configuration import (
    ZooConfig,
    ZooLARAConfig,
    ZooPerformerConfig,
    ZooRAConfig,
    ZooReformerConfig,
    ZooSoftmaxConfig,
)
from attnzoo.modeling import (
    ATTENTION_REGISTRY,
    ZooAttention,
    ZooCache,
    modeling_lara,
    modeling_performer,
    modeling_ra,
    modeling_reformer,
    modeling_softmax,
    register_attention,
)
from attnzoo.modeling.modeling_lara import *  # noqa: F403  (each family module lists its classes)
from attnzoo.modeling.modeling_performer import *  # noqa: F403
from attnzoo.modeling.modeling_ra import *  # noqa: F403
from attnzoo.modeling.modeling_reformer import *  # noqa: F403
from attnzoo.modeling.modeling_softmax import *  # noqa: F403
from attnzoo.registration import register_family

__version__ = "0.1.0"

register_family(ZooSoftmaxConfig, modeling_softmax, "ZooSoftmax")
register_family(ZooReformerConfig, modeling_reformer, "ZooReformer")
register_family(ZooPerformerConfig, modeling_performer, "ZooPerformer")
register_family(ZooRAConfig, modeling_ra, "ZooRA")
register_family(ZooLARAConfig, modeling_lara, "ZooLARA")

__all__ = [
    "ATTENTION_REGISTRY",
    "ZooAttention",
    "ZooCache",
    "ZooConfig",
    "ZooLARAConfig",
    "ZooPerformerConfig",
    "ZooRAConfig",
    "ZooReformerConfig",
    "ZooSoftmaxConfig",
    "register_attention",
    *modeling_softmax.__all__,
    *modeling_reformer.__all__,
    *modeling_performer.__all__,
    *modeling_ra.__all__,
    *modeling_lara.__all__,
]
