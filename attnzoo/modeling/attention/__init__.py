"""Attention modules by name. Importing a module file registers it (see `base.py` for the contract); every module
file of this package is imported here, so a new attention is one new file."""

import importlib
import pkgutil

from attnzoo.modeling.attention.base import (
    ATTENTION_REGISTRY,
    DrawsPerForward,
    InitialisesBuffers,
    Recomputation,
    UsesRecomputation,
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
from attnzoo.modeling.attention.windowed import FAR_PART_REGISTRY, FarPart, WindowedAttention, register_far_part

__all__ = [
    "ATTENTION_REGISTRY",
    "DrawsPerForward",
    "EluAttention",
    "FAR_PART_REGISTRY",
    "FarPart",
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
    "UsesRecomputation",
    "WindowedAttention",
    "ZooAttention",
    "build_attention",
    "register_attention",
    "register_far_part",
    "softmax_attention_reference",
]

# The modules not named above (a new attention file, say) register themselves on import. A checkpoint's flat copy of
# this file is no package (no __path__): there the entry file imports the attention modules its layers use.
if "__path__" in globals():
    for _module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{_module.name}")
