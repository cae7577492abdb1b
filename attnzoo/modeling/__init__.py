from attnzoo.modeling import heads, modeling_reformer, modeling_softmax
from attnzoo.modeling.attention import ATTENTION_REGISTRY, ZooAttention, register_attention
from attnzoo.modeling.cache import ZooCache

__all__ = ["ATTENTION_REGISTRY", "ZooAttention", "ZooCache", "heads", "modeling_reformer", "modeling_softmax",
           "register_attention"]
