"""Attention modules by name. Importing a module file registers it (see `base.py` for the contract)."""

from attnzoo.modeling.attention.base import (
    ATTENTION_REGISTRY,
    DrawsPerForward,
    InitialisesBuffers,
    Recomputation,
    ZooAttention,
    build_attention,
    register_attention,
)
from attnzoo.modeling.attention.favor import EluAttention, FavorAttention, KernelAttention
from attnzoo.modeling.attention.lara import LinearRandomizedAttention
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.modeling.attention.randomized import RandomizedAttention
from attnzoo.modeling.attention.softmax import SoftmaxAttention, SoftmaxCrossAttention, softmax_attention_reference

__all__ = [
    "ATTENTION_REGISTRY",
    "DrawsPerForward",
    "EluAttention",
    "FavorAttention",
    "InitialisesBuffers",
    "KernelAttention",
    "LSHAttention",
    "LinearRandomizedAttention",
    "LocalAttention",
    "RandomizedAttention",
    "Recomputation",
    "SoftmaxAttention",
    "SoftmaxCrossAttention",
    "ZooAttention",
    "build_attention",
    "register_attention",
    "softmax_attention_reference",
]
