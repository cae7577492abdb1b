"""Hybrid stacks: one model whose layers use attention kinds of several families, e.g. exact softmax every fourth
layer and FAVOR+ in the others (the inter-layer hybrids the linearizing literature keeps to hold quality: "The
Mamba in the Llama", arXiv 2408.15237; "LoLCATs", arXiv 2410.10254), or local windows beside FAVOR+ layers.

`ZooHybridConfig` is built from the settings of every family's attentions (`ZooReformerSettings`,
`ZooPerformerSettings`, `ZooRASettings`, `ZooLARASettings`, `ZooBlockRetrievalSettings`, `ZooWindowSettings`), not
from the family configs, so
`attn_layers` may name any registered attention kind, one entry per layer (a shorter list repeats), each setting keeps
its meaning and its checks, and the backbone's defaults are `ZooConfig`'s (no family's set-up, such as the
Reformer's reversible, axial, ReLU one, to undo).
"""

from __future__ import annotations

from attnzoo.configuration.block_retrieval import ZooBlockRetrievalSettings
from attnzoo.configuration.lara import ZooLARASettings
from attnzoo.configuration.performer import ZooPerformerSettings
from attnzoo.configuration.ra import ZooRASettings
from attnzoo.configuration.reformer import ZooReformerSettings
from attnzoo.configuration.window import ZooWindowSettings


class ZooHybridConfig(ZooReformerSettings, ZooPerformerSettings, ZooRASettings, ZooLARASettings,
                      ZooBlockRetrievalSettings, ZooWindowSettings):
    r"""
    A stack that mixes attention kinds across families, configured per layer.

    Args: every field of `ZooConfig` and of the settings above. `attn_layers` lists one attention kind per layer, for
    example
    `["favor", "favor", "favor", "full"]` (one softmax layer in four) or `["local", "favor"]`. The default is
    three FAVOR+ layers then one exact softmax layer, repeated; a stack of fewer than four layers keeps its last
    layer softmax (`["favor", "full"]` for two, `["full"]` for one). A list longer than the stack is refused.
    """

    model_type = "attnzoo_hybrid"

    attn_layers: list[str] | tuple[str, ...] = ("favor", "favor", "favor", "full")
    decoder_attn_layers: list[str] | tuple[str, ...] = ("full",)

    def default_layout(self, name: str, depth: int) -> list[str]:
        """Cutting "favor, favor, favor, full" to a shallower stack would drop its softmax layer: the last layer
        stays exact instead."""
        if name != "attn_layers":
            return super().default_layout(name, depth)
        return ["favor"] * (depth - 1) + ["full"]
