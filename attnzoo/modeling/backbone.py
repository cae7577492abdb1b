"""The one Transformer every family shares: pre-normalisation blocks in a standard or reversible residual stack.

Normalisation (LayerNorm or RMSNorm), feed-forward (standard or gated), positions (added to the embeddings, or
rotary inside every attention) and grouped key/value heads are config switches, so a GPT-2, a Reformer and a Llama
layer are the same block (docs/llama_backbones.md).

A block has an attention branch F (self-attention, then cross-attention for encoder-decoder decoders) and a
feed-forward branch G. The standard stack computes x + F(x), then + G(.); the reversible stack keeps two streams,
y1 = x1 + F(x2), y2 = x2 + G(y1) ("Reformer: The Efficient Transformer", arXiv 2001.04451, §3, after "The Reversible
Residual Network", arXiv 1707.04585), starts both at the embeddings and ends with their mean, so the
heads see `hidden_size` features either way, or, with `reversible_merge="concat"`, with both streams side by side
(2 * hidden_size features, as trax's and transformers' Reformer do).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from attnzoo.modeling.attention import DrawsPerForward, SoftmaxCrossAttention, UsesRecomputation, build_attention
from attnzoo.modeling.attention.base import static_key_mask
from attnzoo.modeling.cache import check_static_capacity
from attnzoo.modeling.embeddings import PositionEmbedding
from attnzoo.modeling.normalization import build_norm
from attnzoo.modeling.reversible import ReversibleStackFunction, stream_step
from attnzoo.transformers_compat import drops_cache_under_checkpointing, static_capacity

logger = logging.get_logger(__name__)


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the whole branch for a random subset of examples (scaled to keep the mean)."""
    if rate == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - rate)
    return x * keep / (1.0 - rate)


def padding_mask(attention_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The (batch, keys) padding mask as bool: any non-zero value marks a real token, 0 a padded one (so positions,
    attention and pooling all read it alike). Other shapes are refused: attnzoo's attentions build their own causal
    and window structure, so a 4-D mask has no meaning here."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; attnzoo models take a 2-D "
                         "(batch, length) padding mask (1 = real token, 0 = padding) and build causal and window "
                         "masks themselves.")
    if attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the batch has {batch} examples; "
                         "pass one mask row per example.")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


class FeedForward(nn.Module):
    """fc_out(act(fc_in(x))), GPT-2's and BERT's feed-forward."""

    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class GatedFeedForward(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), the gated linear unit of Llama ("GLU Variants Improve
    Transformer", arXiv 2002.05202; SwiGLU with hidden_act="silu")."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class ZooBlock(GradientCheckpointingLayer):
    """One pre-LayerNorm Transformer layer; its attention kind comes from the registry."""

    def __init__(self, config, layer_idx: int, attention_kind: str, causal: bool, cross_attention: bool,
                 drop_path_rate: float, kinds_field: str = "attn_layers"):
        super().__init__()
        self.attn_norm = build_norm(config, config.hidden_size)
        self.attn = build_attention(attention_kind, config, layer_idx, causal, kinds_field)
        self.cross_norm = build_norm(config, config.hidden_size) if cross_attention else None
        self.cross_attn = SoftmaxCrossAttention(config, layer_idx) if cross_attention else None
        self.ffn_norm = build_norm(config, config.hidden_size)
        self.ffn = GatedFeedForward(config) if config.mlp_type == "gated" else FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.drop_path_rate = drop_path_rate
        self.ffn_chunk_size = config.chunk_size_feed_forward

    def _drop_branch(self, x):
        """A branch output before it joins the residual stream: dropout, then stochastic depth (drop-path)."""
        return drop_path(self.dropout(x), self.drop_path_rate, self.training)

    def attention_branch(self, x, encoder_hidden_states=None, *, attention_mask=None, cache=None,
                         encoder_attention_mask=None, recompute=None, position_ids=None):
        """F(x): self-attention, then (decoders of encoder-decoder models) cross-attention on x + self-attention.
        `recompute` is the reversible stack's `Recomputation` for this block (see attention/base.py);
        `position_ids` reach attentions with rotary positions."""
        self_cache = getattr(cache, "self_attention_cache", cache)
        self.attn.check_cache_slot(self_cache)
        extra = {"recompute": recompute} if isinstance(self.attn, UsesRecomputation) else {}
        if getattr(self.attn, "rotary", None) is not None:
            extra["position_ids"] = position_ids
        out = self._drop_branch(self.attn(self.attn_norm(x), attention_mask=attention_mask, cache=self_cache, **extra))
        if self.cross_attn is not None:
            cross_cache = cache if hasattr(cache, "cross_attention_cache") else None
            cross = self.cross_attn(self.cross_norm(x + out), encoder_hidden_states, encoder_attention_mask,
                                    cross_cache)
            out = out + self._drop_branch(cross)
        return out

    def feed_forward_branch(self, x):
        """G(x): the feed-forward, over sequence chunks of `chunk_size_feed_forward` when set (Reformer §3)."""
        if not self.chunked_feed_forward(x):
            return self._drop_branch(self._feed_forward(x))
        # Sequential chunks bound the [chunk, intermediate_size] activation (a memory-for-time trade by design).
        # transformers' apply_chunking_to_forward is not used: it refuses lengths that are not a chunk multiple.
        out = torch.cat([self._feed_forward(part) for part in x.split(self.ffn_chunk_size, dim=1)], dim=1)
        scale = self._residual_scale(out)
        return out if scale is None else out * scale

    def chunked_feed_forward(self, x) -> bool:
        return bool(self.ffn_chunk_size) and x.shape[1] > self.ffn_chunk_size

    def _residual_scale(self, like):
        """The random factor `_drop_branch` multiplies a branch output by (dropout, drop-path), drawn exactly as
        `_drop_branch(like)` would draw it, or None when there is none."""
        if not self.training or (self.dropout.p == 0.0 and self.drop_path_rate == 0.0):
            return None
        return self._drop_branch(torch.ones_like(like))

    def _feed_forward(self, x):
        return self.ffn(self.ffn_norm(x))

    def forward(self, hidden_states, encoder_hidden_states=None, **block_kwargs):
        hidden_states = hidden_states + self.attention_branch(hidden_states, encoder_hidden_states, **block_kwargs)
        return hidden_states + self.feed_forward_branch(hidden_states)


class ZooTransformer(nn.Module):
    """Position embeddings, the block stack and the final LayerNorm, over given token embeddings.

    `decoder_side` selects `decoder_attn_layers`/`num_decoder_layers` (the decoder of an encoder-decoder model);
    `cross_attention` adds cross-attention to every block; `with_positions=False` leaves positions to the caller
    (image patches carry their own).
    """

    def __init__(self, config, causal: bool, decoder_side: bool = False, cross_attention: bool = False,
                 with_positions: bool = True):
        super().__init__()
        self.causal = causal
        self.reversible = config.reversible
        self.concat_streams = config.reversible and config.reversible_merge == "concat"
        #: the reversible stack's recomputing backward; tests switch it off to compare with plain autograd.
        self.use_reversible_backward = True
        self.positions = PositionEmbedding(config) if with_positions else None
        self.embed_dropout = nn.Dropout(config.hidden_dropout_prob)
        kinds = config.layer_attention_kinds(decoder=decoder_side)
        kinds_field = "decoder_attn_layers" if decoder_side else "attn_layers"
        # Plain floats (no tensor), so the model can be built on the meta device (deferred initialisation).
        rates = [config.drop_path_rate * i / (len(kinds) - 1) for i in range(len(kinds))] if len(kinds) > 1 else [0.0]
        self.blocks = nn.ModuleList(
            ZooBlock(config, i, kind, causal, cross_attention, rates[i], kinds_field) for i, kind in enumerate(kinds)
        )
        self.final_norm = build_norm(config, config.stack_output_size)
        self.rotary = config.position_embedding_type == "rotary"

    def new_cache_layers(self, max_cache_len: int | None = None):
        """One decoding cache slot per block: growing ones, or static ones for up to `max_cache_len` positions."""
        if max_cache_len is None:
            return [block.attn.new_cache_layer() for block in self.blocks]
        check_static_capacity(max_cache_len)
        slots = [block.attn.new_static_cache_layer(max_cache_len) for block in self.blocks]
        if None in slots:
            kinds = sorted({block.attn.name for block, slot in zip(self.blocks, slots, strict=True) if slot is None})
            raise ValueError(f"a static cache (max_cache_len={max_cache_len}) is not available for attention "
                             f"{', '.join(map(repr, kinds))}; decode with the growing cache instead (leave "
                             "max_cache_len and cache_implementation unset).")
        return slots

    def set_image_layout(self, grid_size: tuple[int, int], class_token: bool) -> None:
        """Tell every attention that the tokens are an image's patch grid (after a class token when `class_token`)."""
        for block in self.blocks:
            block.attn.set_image_layout(grid_size, class_token)

    def forward(self, inputs_embeds, attention_mask=None, position_ids=None, cache=None,
                encoder_hidden_states=None, encoder_attention_mask=None, output_hidden_states=False):
        batch, length = inputs_embeds.shape[:2]
        if batch == 0 or length == 0:
            raise ValueError(f"the input is empty ({batch} examples of {length} tokens): pass at least one token of "
                             "one example.")
        if cache is not None and drops_cache_under_checkpointing(self.blocks, self.training):
            logger.warning_once("the cache is not used while activation checkpointing recomputes the blocks "
                                "(it would be written twice); the forward runs without it.")
            cache = None
        # A static cache counts its positions in a 0-d tensor, which is never read on the host here: its masks have
        # its capacity's columns (those not written yet count as padding), so every decode step has the same shapes.
        past_length = cache.get_seq_length() if cache is not None else 0
        capacity = static_capacity(cache)
        if capacity is not None:
            self._check_static_capacity(capacity, past_length, length)
        if attention_mask is not None:
            attention_mask = padding_mask(attention_mask, batch)
            if capacity is not None:
                attention_mask = static_key_mask(attention_mask, batch, capacity)
            elif attention_mask.shape[-1] != past_length + length:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} tokens but there are {past_length} cached and "
                    f"{length} new ones; pass a mask of shape ({batch}, {past_length + length})."
                )
        hidden = inputs_embeds
        if self.positions is not None:
            if capacity is None:  # a static cache's capacity was checked against the positions above
                self.positions.check_length(past_length + length)
            if position_ids is None:
                position_ids = self._position_ids(attention_mask, past_length, length, inputs_embeds.device)
            pos = self.positions(position_ids)
            if pos is not None:
                hidden = hidden + pos.to(hidden.dtype)
        hidden = self.embed_dropout(hidden)
        for block in self.blocks:  # once per forward pass, never on a recomputation
            if isinstance(block.attn, DrawsPerForward):
                block.attn.start_forward()

        block_kwargs = dict(attention_mask=attention_mask, cache=cache,
                            encoder_attention_mask=encoder_attention_mask)
        if self.rotary and self.positions is not None:
            block_kwargs["position_ids"] = position_ids
        all_hidden = [hidden] if output_hidden_states else None
        if self.reversible:
            hidden = self._reversible(hidden, encoder_hidden_states, block_kwargs, all_hidden)
        else:
            for block in self.blocks:
                hidden = block(hidden, encoder_hidden_states, **block_kwargs)
                if all_hidden is not None:
                    all_hidden.append(hidden)
        hidden = self.final_norm(hidden)
        if all_hidden is not None:  # the last entry is the final normalised output, as GPT-2 and Llama give it
            all_hidden[-1] = hidden
        return hidden, (tuple(all_hidden) if all_hidden is not None else None)

    def _check_static_capacity(self, capacity: int, past_length, length: int) -> None:
        """Refuse input that a static cache of `capacity` positions cannot hold (its writes would fall outside its
        buffers): checked on the host in eager mode (one read of the count per forward); a compiled step cannot
        read it, and an out-of-range write fails there as an index error."""
        if self.positions is not None and self.positions.kind in ("learned", "axial") and \
                capacity > self.positions.max_positions:
            raise ValueError(f"max_cache_len={capacity} exceeds max_position_embeddings="
                             f"{self.positions.max_positions}, the positions this model has; build the static cache "
                             f"with max_cache_len <= {self.positions.max_positions} (generate(): max_new_tokens and "
                             "generation_config.max_cache_len).")
        if torch.compiler.is_compiling():
            return
        total = int(past_length) + length
        if total > capacity:
            raise ValueError(f"the cache holds {int(past_length)} positions and the input adds {length}, but the "
                             f"static cache holds max_cache_len={capacity}; build the cache with max_cache_len >= "
                             f"{total} (generate(): it is sized from max_new_tokens).")

    @staticmethod
    def _position_ids(attention_mask, past_length, length, device):
        """Positions of the new tokens, which sit at mask columns past_length .. past_length + length - 1 (the last
        ones, except in a static cache's mask); `past_length` may be a 0-d tensor."""
        columns = past_length + torch.arange(length, device=device)
        if attention_mask is None:
            return columns[None]
        # Count only real tokens, so a left-padded sequence gets the positions it would have alone.
        positions = (attention_mask.bool().long().cumsum(-1) - 1).clamp(min=0)
        return positions.gather(1, columns[None].expand(positions.shape[0], -1))

    def _reversible(self, hidden, encoder_hidden_states, block_kwargs, all_hidden):
        needs_grad = torch.is_grad_enabled() and (
            hidden.requires_grad or any(p.requires_grad for p in self.blocks.parameters())
        )
        # The recomputing backward would write a cache twice; with a cache (decoding) plain autograd is used.
        cached = block_kwargs["cache"] is not None
        reversible_backward = needs_grad and self.use_reversible_backward and all_hidden is None and not cached
        # torch.compile cannot trace the recomputing backward (it captures RNG states and calls autograd inside
        # backward); there each block is activation-checkpointed instead, which compile traces: memory then grows with
        # depth by two stream tensors per block instead of by all of a block's activations.
        checkpointed = reversible_backward and torch.compiler.is_compiling()
        if reversible_backward and not checkpointed:
            params = [p for p in self.blocks.parameters() if p.requires_grad]
            return ReversibleStackFunction.apply(self.blocks, block_kwargs, self.concat_streams, hidden,
                                                 encoder_hidden_states, *params)
        # Plain autograd through the same two-stream computation (inference, hidden-state outputs, tests).
        x1 = x2 = hidden
        if all_hidden is not None and self.concat_streams:
            all_hidden[0] = self._merge(x1, x2)
        for block in self.blocks:
            if checkpointed:
                x1, x2 = checkpoint(stream_step, block, x1, x2, encoder_hidden_states, block_kwargs,
                                    use_reentrant=False)
            else:
                x1, x2 = stream_step(block, x1, x2, encoder_hidden_states, block_kwargs)
            if all_hidden is not None:
                all_hidden.append(self._merge(x1, x2))
        return self._merge(x1, x2)

    def _merge(self, x1, x2):
        return torch.cat([x1, x2], dim=-1) if self.concat_streams else (x1 + x2) / 2
