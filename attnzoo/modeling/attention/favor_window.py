"""FAVOR+ as the far part of a windowed layer ("favor_window"): each query attends exactly, with softmax weights, to
its window and sinks (`window_size`, `num_sink_tokens`, as the "window" attention), and through FAVOR+'s random
features to every earlier key outside them, with ONE normalisation over both parts (`windowed.WindowedAttention`):

    out_i = (Σ_{j∈near(i)} exp(s_ij) v_j + Σ_{j∈far(i)} φ(q_i)·φ(k_j) v_j)
            / (Σ_{j∈near(i)} exp(s_ij)     + Σ_{j∈far(i)} φ(q_i)·φ(k_j)),      s_ij = q_i·k_j / √d.

FAVOR+'s positive features estimate exp(s_ij) without bias, so both parts weigh keys on the same scale and no mixing
factor is needed: the layer is exact softmax attention where the window reaches, and FAVOR+ beyond it. This is the
window-plus-linear layer of LoLCATs (arXiv 2410.10254, §3.2: 64-token windows with a learned feature map) and
Liger (arXiv 2503.01496), with Performer's unbiased features ("Rethinking Attention with Performers", arXiv
2009.14794) as the linear part. With `feature_redraw="learned"` the projection is trained (attention transfer).

The blocked parallel form, its stabilisation and the decoding sums are `window_linear.FeatureFarPart`'s: FAVOR+ only
says what its log-features are, a = ℓ(q̂, w_p) − log m and b = ℓ(k̂, w_p) (so Σ_p exp(a + b) is the mean over
the m features). The projection and its redraw policy are the "favor" attention's (`favor.FavorProjection`), kept on
the layer under the same names, so a "favor" checkpoint's projection loads into "favor_window". Decoding keeps the
ring of the window plus FAVOR+'s per-feature sums over the keys that left it: bounded memory.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnzoo.modeling.attention.favor import FavorProjection
from attnzoo.modeling.attention.random_features import log_positive_features
from attnzoo.modeling.attention.window_linear import FeatureFarPart
from attnzoo.modeling.attention.windowed import register_far_part


@register_far_part("favor")
class FavorFarPart(FavorProjection, FeatureFarPart):
    """FAVOR+'s features beyond the window; see the module docstring."""

    family_config = "ZooPerformerSettings"
    plain_kind = "favor"

    def __init__(self, layer, config):
        super().__init__(layer, config)
        self.add_projection(config)

    @property
    def projection_owner(self) -> nn.Module:
        return self.layer

    def start_forward(self) -> None:
        self.start_projection_forward()

    def init_buffers(self) -> None:
        self.init_projection()

    def loaded(self) -> None:
        self.projection_loaded()

    def key_log_features(self, k: torch.Tensor, constants: dict | None = None) -> torch.Tensor:
        return log_positive_features(k, self.projection(constants), self.hyperbolic)

    def query_log_features(self, q: torch.Tensor, constants: dict | None = None) -> torch.Tensor:
        log_q = log_positive_features(q, self.projection(constants), self.hyperbolic)
        return log_q - math.log(log_q.shape[-1])  # (1/m) Σ_r exp(ℓ_r(q) + ℓ_r(k)): the 1/m on the query side
