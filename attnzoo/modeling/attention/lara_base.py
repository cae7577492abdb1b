"""What bidirectional and causal LARA share ("Linear Complexity Randomized Self-attention Mechanism", arXiv
2204.04667, §4): the settings, read and checked once, the landmark transforms and the sample draws (`LARASettings`,
which the windowed layer's LARA far part uses too), and the projections (`LARABase`). `lara_causal` adds the causal
estimator (`CausalLARATerms`) and `lara.LinearRandomizedAttention` the bidirectional one."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnzoo.modeling.attention.base import ZooAttention
from attnzoo.modeling.attention.random_features import sample_noise_std


class LARASettings:
    """LARA's settings, read and checked once, its landmark transforms (added to `owner`: the attention, or the
    windowed layer a LARA far part serves) and its draws. Users read `landmark_q`, `landmark_k` from the owner."""

    def add_lara_settings(self, config, causal: bool, owner: nn.Module) -> None:
        self.num_proposals = config.lara_num_samples
        self.samples_per_proposal = config.lara_samples_per_proposal
        self.landmarks = config.lara_landmarks
        self.proposal_mean = config.lara_proposal_mean
        self.weighting = config.lara_weighting
        self.alpha_coeff = config.lara_alpha_coeff
        self.r_normalize = config.lara_r_normalize
        self.chunk_size = config.lara_chunk_size
        self.noise_std = sample_noise_std(config.sample_noise_std, self.head_dim)
        if config.lara_landmark_transform:  # "light" mode: one Linear+LayerNorm on the head dimension, all heads
            owner.landmark_q = nn.Sequential(nn.Linear(self.head_dim, self.head_dim), nn.LayerNorm(self.head_dim))
            owner.landmark_k = nn.Sequential(nn.Linear(self.head_dim, self.head_dim), nn.LayerNorm(self.head_dim))
        else:
            owner.landmark_q = owner.landmark_k = None
        if causal and self.samples_per_proposal != 1:
            raise ValueError("causal LARA draws one sample per proposal; set lara_samples_per_proposal=1.")

    def _transform(self, module, x):
        return x if module is None else module(x.to(module[0].weight.dtype)).to(x.dtype)

    def _draw(self, mu):
        if self.training and self.noise_std:
            # randn(shape), not randn_like: the draws must not depend on the tensor's memory layout.
            return mu + self.noise_std * torch.randn(mu.shape, device=mu.device, dtype=mu.dtype)
        return mu


class LARABase(LARASettings, ZooAttention):
    """A LARA attention module: projections, `LARASettings`, and the image layout of an image encoder."""

    family_config = "ZooLARASettings"

    def __init__(self, config, layer_idx: int, causal: bool):
        super().__init__(config, layer_idx, causal)
        self.build_projections()
        self.add_lara_settings(config, causal, self)
        self._segment_cache = {}
        self.image_grid = None  # (rows, cols) when an image encoder declares its patch grid

    def set_image_layout(self, grid_size, class_token: bool) -> None:
        """2-D landmarks (pooled grid cells) when the tokens are exactly the patch grid; validated here, at
        construction."""
        self.image_grid = tuple(grid_size)
        two_d = self.landmarks == "2d" or (self.landmarks == "auto" and not class_token)
        if not two_d:
            return
        if class_token:
            raise ValueError("lara_landmarks='2d' needs the tokens to be exactly the patch grid, but this image model "
                             "has a class token (pooling='cls'); use pooling='mean' or lara_landmarks='1d'.")
        side = math.isqrt(self.num_proposals)
        if side * side != self.num_proposals:
            raise ValueError(f"lara_num_samples={self.num_proposals} is invalid for this image model: its tokens are "
                             f"a {grid_size[0]}x{grid_size[1]} patch grid, so landmarks are pooled grid cells "
                             f"(lara_landmarks={self.landmarks!r}) and the count must be a perfect square (e.g. "
                             f"{max(1, side) ** 2} or {(side + 1) ** 2}), or set lara_landmarks='1d'.")

    def _inputs(self, hidden_states, position_ids=None, past: int = 0):
        """q, k, v [batch, heads, length, head_dim] in float32 at least, q and k rotated in rotary models, k and v
        repeated for their query-head groups."""
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = (self.split_heads(p(hidden_states)).to(compute) for p in (self.q_proj, self.k_proj, self.v_proj))
        rotation = self.rotation(position_ids, past, q.shape[2], q.device, compute)
        return self.rotate(q, rotation), self.expand_kv(self.rotate(k, rotation)), self.expand_kv(v)
