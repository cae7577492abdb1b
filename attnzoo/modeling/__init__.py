from attnzoo.modeling import heads
from attnzoo.modeling.attention import ATTENTION_REGISTRY, ZooAttention, register_attention
from attnzoo.modeling.cache import ZooCache

__all__ = ["ATTENTION_REGISTRY", "ZooAttention", "ZooCache", "heads", "register_attention"]
