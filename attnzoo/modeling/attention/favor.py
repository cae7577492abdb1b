"""Kernelised linear attention: Performer's FAVOR+ (positive or hyperbolic random features; "Rethinking Attention with
Performers", arXiv 2009.14794) and the deterministic elu+1 map ("Transformers are RNNs", arXiv 2006.16236).

Bidirectional attention uses the linear form. Causal attention stabilises keys by their running maximum and runs
the exact decayed causal form (`attnzoo.ops.decayed_linear_attention`: chunked PyTorch on the CPU, fused Triton
kernels on CUDA); decoding runs its recurrent form from a `RecurrentStateLayer` holding (S, z, running max): every new
token costs the same whatever the context length.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from attnzoo.modeling.attention.base import (
    DrawsPerForward,
    InitialisesBuffers,
    ZooAttention,
    check_attention_mask,
    register_attention,
)
from attnzoo.modeling.attention.random_features import (
    elu_features,
    gaussian_projection,
    linear_attention_bidirectional,
    linear_attention_reference,
    log_positive_features,
    running_max_key_features,
    stabilised_key_features,
    stabilised_query_features,
)
from attnzoo.modeling.cache import RecurrentStateLayer, StaticRecurrentStateLayer
from attnzoo.ops.decayed_linear_attention import decayed_linear_attention, decayed_linear_attention_step


class KernelAttention(ZooAttention):
    """Linear attention over positive features given in log space by `log_features(x, cache_slot)`."""

    family_config = "ZooPerformerSettings"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.chunk_size = config.linear_attention_chunk_size

    def log_features(self, x: torch.Tensor, layer: RecurrentStateLayer | None = None) -> torch.Tensor:
        """Log-features [B, H, N, r] of x [B, H, N, d]; `layer` is the decoding cache slot, when decoding (a
        random-feature map keeps its projection there, so a whole generation uses one)."""
        raise NotImplementedError

    def new_cache_layer(self):
        return RecurrentStateLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return StaticRecurrentStateLayer(max_cache_len)  # (S, z, M) updated in place

    def _heads(self, hidden_states, position_ids=None, past: int = 0):
        # Linear attention sums over the whole sequence: accumulate in float32 at least, whatever the model dtype.
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = (self.split_heads(proj(hidden_states)).to(compute) for proj in (self.q_proj, self.k_proj,
                                                                                   self.v_proj))
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, compute)
        return self.rotate(q, rotation), self.expand_kv(self.rotate(k, rotation)), self.expand_kv(v)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        layer = self.cache_slot(cache)
        if layer is not None and not self.causal:
            raise ValueError("a cache is only used by causal (decoder) attention.")
        batch, length, _ = hidden_states.shape
        past, _, key_mask = self.key_masks(attention_mask, layer, batch, length)  # the new tokens' columns
        q, k, v = self._heads(hidden_states, position_ids, past)
        phi_q = stabilised_query_features(self.log_features(q, layer))
        log_phi_k = self.log_features(k, layer)
        if not self.causal:
            phi_k, _ = stabilised_key_features(log_phi_k, key_mask)
            out = linear_attention_bidirectional(phi_q, phi_k, v)
        else:
            out = self._causal(phi_q, log_phi_k, v, key_mask, layer)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))

    def _causal(self, phi_q, log_phi_k, v, key_mask, layer: RecurrentStateLayer | None):
        """Causal linear attention with keys stabilised by their running maximum: the chunked parallel form (fused on
        CUDA), or, with a cache slot, the recurrent form continuing from its state (S, z, M) and storing the new
        state. Both compute the same function; no output depends on a later token."""
        state = None
        if layer is not None and layer.state:  # S = Σ φk vᵀ, z = Σ φk and the running maximum M, as stored
            state = (layer.state["kv_sum"], layer.state["key_sum"], layer.state["running_max"])
        phi_k, running_max = running_max_key_features(log_phi_k, key_mask, None if state is None else state[2])
        if layer is None:
            return decayed_linear_attention(phi_q, phi_k, v, running_max, self.chunk_size)
        if phi_q.shape[2] == 1 and state is not None:
            out, (s, z, m) = decayed_linear_attention_step(phi_q, phi_k, v, running_max, state)
        else:  # a prefill, or several tokens at once over a cache
            out, (s, z, m) = decayed_linear_attention(phi_q, phi_k, v, running_max, self.chunk_size,
                                                      initial_state=state, return_state=True)
        layer.store(phi_q.shape[2], kv_sum=s, key_sum=z, running_max=m)
        return out

    def reference_forward(self, hidden_states, attention_mask=None, cache=None, position_ids=None):
        """The masked quadratic form over the same features (no cache)."""
        q, k, v = self._heads(hidden_states, position_ids)
        batch, _, length, _ = q.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        phi_q = stabilised_query_features(self.log_features(q, None))
        phi_k, _ = stabilised_key_features(self.log_features(k, None), key_mask)
        allowed = torch.ones(length, length, dtype=torch.bool, device=q.device)
        if self.causal:
            allowed = allowed.tril()
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :]
        out = linear_attention_reference(phi_q, phi_k, v, allowed)
        return self.o_proj(self.merge_heads(out.to(hidden_states.dtype)))


class FavorProjection:
    """FAVOR+'s random projection and its policy (`feature_redraw`), for a module that keeps the projection's tensors
    on `projection_owner` (the attention itself, or the windowed layer a FAVOR+ far part serves):
    "every_step" draws new features for every training forward (the RA/LARA paper's set-up), "interval" every
    `feature_redraw_interval` training forwards (performer-pytorch's), "fixed" never, "learned" trains one
    (`learned_projection`, a parameter). Evaluation uses `eval_projection` (or the learned one), saved with the
    checkpoint, so a reloaded model gives identical outputs. Features are drawn per head, shared across the batch.
    Users of the mixin read `num_heads` and `head_dim` and call `add_projection(config)` once."""

    @property
    def projection_owner(self) -> nn.Module:
        raise NotImplementedError

    def add_projection(self, config) -> None:
        self.num_features = config.num_random_features
        self.hyperbolic = config.feature_map == "hyperbolic"
        self.orthogonal = config.orthogonal_features
        self.norm = config.feature_norm
        self.redraw = config.feature_redraw
        self.redraw_interval = config.feature_redraw_interval
        owner = self.projection_owner
        shape = (self.num_heads, self.num_features, self.head_dim)
        # Filled by init_buffers() (from _init_weights) unless a checkpoint provides them.
        if self.redraw == "learned":  # one trained projection, in training and evaluation
            owner.learned_projection = nn.Parameter(torch.empty(shape))
        else:
            owner.register_buffer("eval_projection", torch.empty(shape), persistent=True)
        if self.redraw == "interval":
            owner.register_buffer("train_projection", torch.empty(shape), persistent=True)
            owner.register_buffer("redraw_counter", torch.zeros((), dtype=torch.long), persistent=True)
        self._step_projection = None  # this training step's draw ("every_step"), set by start_forward()
        self._calls = None  # a host copy of redraw_counter, so start_forward() never waits for the device

    def init_projection(self) -> None:
        owner = self.projection_owner
        if self.redraw == "learned":
            init.copy_(owner.learned_projection, self.draw_projection(owner.learned_projection.device))
            return
        init.copy_(owner.eval_projection, self.draw_projection(owner.eval_projection.device))
        if self.redraw == "interval":
            init.copy_(owner.train_projection, self.draw_projection(owner.train_projection.device))
            init.zeros_(owner.redraw_counter)
        self._calls = None

    def projection_loaded(self) -> None:
        self._calls = None  # re-read the loaded counter (e.g. after accelerator.load_state)

    def draw_projection(self, device=None) -> torch.Tensor:
        return gaussian_projection((self.num_heads, self.num_features), self.head_dim, orthogonal=self.orthogonal,
                                   norm=self.norm, device=device)

    def start_projection_forward(self) -> None:
        """The training projection of this forward pass: a new draw ("every_step"), the interval's draw
        ("interval"), or none ("fixed" and evaluation use `eval_projection`)."""
        owner = self.projection_owner
        if not owner.training or self.redraw in ("fixed", "learned"):
            return
        if self.redraw == "every_step":
            self._step_projection = self.draw_projection(owner.eval_projection.device)
        else:
            if self._calls is None:
                self._calls = int(owner.redraw_counter)  # once after construction or loading
            if self._calls % self.redraw_interval == 0:
                owner.train_projection.copy_(self.draw_projection(owner.train_projection.device))
            self._calls += 1
            owner.redraw_counter.fill_(self._calls)

    def projection(self, constants: dict | None) -> torch.Tensor:
        """The projection of this forward; `constants`: a decoding generation's constants (a cache slot's
        `shared`), where the first call puts its projection and every later call reads it: one projection for a
        whole generation."""
        if constants is not None and "projection" in constants:
            return constants["projection"]
        owner = self.projection_owner
        if self.redraw == "learned":
            projection = owner.learned_projection
        elif not owner.training or self.redraw == "fixed":
            projection = owner.eval_projection
        elif self.redraw == "interval":
            projection = owner.train_projection
        elif self._step_projection is not None:
            projection = self._step_projection
        else:
            raise RuntimeError("a training forward of an 'every_step' FAVOR layer needs start_forward() first; the "
                               "model's Transformer calls it, so call the model rather than the layer alone.")
        if constants is not None:
            constants["projection"] = projection
        return projection


@register_attention("favor")
class FavorAttention(FavorProjection, DrawsPerForward, InitialisesBuffers, KernelAttention):
    """Performer's FAVOR+: exp(q̂·k̂) estimated with positive (or hyperbolic) random features, drawn and redrawn as
    `FavorProjection` says."""

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.add_projection(config)

    @property
    def projection_owner(self) -> nn.Module:
        return self

    def start_forward(self) -> None:
        self.start_projection_forward()

    def init_buffers(self) -> None:
        self.init_projection()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.projection_loaded()

    def log_features(self, x, layer=None):
        return log_positive_features(x, self.projection(None if layer is None else layer.shared), self.hyperbolic)


@register_attention("elu")
class EluAttention(KernelAttention):
    """Linear attention with the deterministic feature map elu(x) + 1 (Katharopoulos et al., arXiv 2006.16236)."""

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.alpha = config.elu_alpha

    def log_features(self, x, layer=None):
        return torch.log(elu_features(x, self.alpha))
