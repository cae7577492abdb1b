"""Hybrid stacks: one model whose layers use attention kinds of several families, e.g. exact softmax every fourth
layer and FAVOR+ in the others (the inter-layer hybrids the linearizing literature keeps to hold quality: "The
Mamba in the Llama", arXiv 2408.15237; "LoLCATs", arXiv 2410.10254), or local windows beside FAVOR+ layers.

`ZooHybridConfig` has every family's settings, so `attn_layers` may name any registered attention kind, one entry
per layer (a shorter list repeats). Each family's settings keep their meaning and their checks; the shared backbone
defaults are `ZooConfig`'s (not the Reformer's reversible, axial, ReLU set-up).
"""

from __future__ import annotations

from attnzoo.configuration.lara import ZooLARAConfig
from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.configuration.ra import ZooRAConfig
from attnzoo.configuration.reformer import ZooReformerConfig


class ZooHybridConfig(ZooReformerConfig, ZooPerformerConfig, ZooRAConfig, ZooLARAConfig):
    r"""
    A stack that mixes attention kinds across families, configured per layer.

    Args: every field of `ZooConfig`, `ZooReformerConfig`, `ZooPerformerConfig`, `ZooRAConfig` and
    `ZooLARAConfig`. `attn_layers` lists one attention kind per layer, for example
    `["favor", "favor", "favor", "full"]` (one softmax layer in four) or `["local", "favor"]`. The default is
    three FAVOR+ layers then one exact softmax layer, repeated; a stack of fewer than four layers keeps its last
    layer softmax (`["favor", "full"]` for two, `["full"]` for one). A list longer than the stack is refused.
    """

    model_type = "attnzoo_hybrid"

    attn_layers: list[str] | tuple[str, ...] = ("favor", "favor", "favor", "full")
    decoder_attn_layers: list[str] | tuple[str, ...] = ("full",)
    # The backbone's own defaults, not the Reformer's enwik8 set-up.
    num_hidden_layers: int = 4
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    attention_bias: bool = True
    reversible: bool = False
    position_embedding_type: str = "learned"
    chunk_size_feed_forward: int = 0

    def default_layout(self, name: str, depth: int) -> list[str]:
        """Cutting "favor, favor, favor, full" to a shallower stack would drop its softmax layer: the last layer
        stays exact instead."""
        if name != "attn_layers":
            return super().default_layout(name, depth)
        return ["favor"] * (depth - 1) + ["full"]
