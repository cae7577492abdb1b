from attnzoo.modeling.attention import ATTENTION_REGISTRY, ZooAttention, register_attention
from attnzoo.modeling.cache import ZooCache

__all__ = ["ATTENTION_REGISTRY", "ZooAttention", "ZooCache", "register_attention"]
