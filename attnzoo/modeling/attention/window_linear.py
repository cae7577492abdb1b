"""Far parts given by positive features (`windowed.FarPart`s): what "favor_window" and "lara_window" share, and
what a far part of the user's with a feature map of its own subclasses (`FeatureFarPart`).

Per head, with positions counted in real tokens, s_ij = q_i·k_j / √d, a window W and S sinks, query i sees
    near(i) = {j: 0 <= pos_i - pos_j < W} ∪ {j: pos_j < S, pos_j <= pos_i}   exactly, and
    far(i)  = {j real: S <= pos_j <= pos_i - W}                             through features:

    out_i = (Σ_{near} exp(s_ij) v_j + Σ_{far} κ_ij v_j) / (Σ_{near} exp(s_ij) + Σ_{far} κ_ij),
    κ_ij = Σ_p exp(a_ip + b_jp),

for query log-features a [B, H, L, P] and key log-features b [B, H, L, P] whose κ estimates exp(s_ij) on the same
scale, so the two parts need no mixing weight: FAVOR+ (a = ℓ(q̂, w_p) − log m, b = ℓ(k̂, w_p); "Rethinking
Attention with Performers", arXiv 2009.14794, §2.3) or causal LARA (a = log α_ip + ℓ(q̂_i, ω_p) − log q̃_p(ω_p),
b = ℓ(k̂_j, ω_p); "Linear Complexity Randomized Self-attention Mechanism", arXiv 2204.04667, §4, and
docs/random_feature_attention.md, section 5). This is the window-plus-linear layer of LoLCATs ("LoLCATs: On Low-Rank
Linearizing of Large Language Models", arXiv 2410.10254, §3.2).

Parallel form (`blocked_far_part`), on blocks of W left-aligned tokens: the far keys of a query in block c are all
keys of blocks <= c − 2 (a prefix sum of per-block feature sums) and those of block c − 1 at offsets <= its own (a
masked [W, W] product), so memory is O(L·(W + S + P) + (L/W)·P·d) and there is no loop over blocks.

Stabilisation, exact and causal: each feature p gets a level E_cp, the running maximum over blocks <= c of the far
keys' b_jp (detached). Block c's keys enter as exp(b_jp − E_cp) <= 1, the prefix sums are decayed by
exp(E_bp − E_cp) <= 1 (`decayed_cumsum`), and the levels are folded into the query side:
exp(a_ip + E_(c−1)p − t_i) with t_i = max_p (a_ip + E_(c−1)p), so every factor is at most 1 and κ_ij =
exp(t_i) · (the stabilised product). t_i is returned as the far part's log scale and cancels in the one
normalisation (`merge_far`). A per-feature level keeps a feature whose keys are all small from being flushed to 0
by another feature's large key (as one maximum over all features would), and the running maximum lets no output
depend on a later token, not even through rounding (docs/random_feature_attention.md, section 2).

Decoding keeps per-feature sums over the keys that have left the window (`far_sums`, `add_far_key`, `read_far`),
with the same per-feature running levels. The dense reference is `dense_feature_far`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.modeling.attention.random_features import NO_KEY_LEVEL
from attnzoo.modeling.attention.window import beyond_window
from attnzoo.modeling.attention.windowed import FarInputs, FarOutput, FarPart
from attnzoo.ops.decayed_linear_attention import decayed_cumsum


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def finite_level(x: torch.Tensor) -> torch.Tensor:
    """A key level with "no key yet" (−inf) replaced by NO_KEY_LEVEL: finite, so level differences never give NaN,
    and low enough that the decay from it to any real key's level is exactly 0."""
    return torch.where(torch.isfinite(x), x, torch.full_like(x, NO_KEY_LEVEL))


def far_key_mask(n_real: torch.Tensor, sinks: int, length: int) -> torch.Tensor:
    """[B, L] of left-aligned tokens: the real keys that are not sinks, the only ones that can be far (the blocks of
    `blocked_far_part` keep each query's window out)."""
    position = torch.arange(length, device=n_real.device)
    return beyond_window(position[None, :], position[None, :], 0, sinks) & (position[None, :] < n_real[:, None])


def keys_far_from(position: torch.Tensor, length: int, window: int, sinks: int) -> torch.Tensor:
    """[B, L]: which of the first `length` (left-aligned) positions are far from a query at `position` [B]."""
    return beyond_window(position[:, None], torch.arange(length, device=position.device)[None, :], window, sinks)


def blocked_far_part(log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor, far_key: torch.Tensor,
                     window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The far part of left-aligned tokens in blocks of `window` (module docstring).

    Args: log_q, log_k [B, H, L, P] query and key log-features (−inf allowed: a feature a query may not use, a key
    that is not there); v [B, H, L, e]; far_key [B, L]: keys that may be far (real, not sinks).

    Returns (far_num [B, H, C, W, e], far_den [B, H, C, W], far_scale [B, H, C, W]) with C = ceil(L / W):
    Σ_far κ_ij v_j = exp(far_scale_i) far_num_i and Σ_far κ_ij = exp(far_scale_i) far_den_i. Query rows past L are
    padding."""
    batch, heads, length, count = log_q.shape
    w = window
    blocks = -(-length // w)
    pad = blocks * w - length
    far_key = F.pad(far_key, (0, pad))
    log_k = F.pad(log_k, (0, 0, 0, pad)).masked_fill(~far_key[:, None, :, None], float("-inf"))
    log_k = log_k.view(batch, heads, blocks, w, count)
    log_q = F.pad(log_q, (0, 0, 0, pad)).view(batch, heads, blocks, w, count)
    # values with a column of ones: the denominator rides along as the last value column
    v_ones = F.pad(F.pad(v, (0, 1), value=1.0), (0, 0, 0, pad)).view(batch, heads, blocks, w, -1)
    level = finite_level(torch.cummax(log_k.detach().amax(3), dim=2).values)  # [B, H, C, P], nondecreasing in C
    phi_k = torch.exp(log_k - level[:, :, :, None, :])  # block c's keys relative to E_c: at most 1
    block_sums = torch.einsum("bhcwp,bhcwe->bhpce", phi_k, v_ones)  # [B, H, P, C, e + 1]
    prefix = decayed_cumsum(block_sums, level.transpose(2, 3))  # blocks <= c, relative to E_c
    # a query in block c reads the prefix of blocks <= c - 2 and the keys of block c - 1
    prefix = F.pad(prefix, (0, 0, 2, 0))[:, :, :, :blocks]
    level_before_prev = F.pad(level, (0, 0, 2, 0), value=NO_KEY_LEVEL)[:, :, :blocks]
    level_prev = F.pad(level, (0, 0, 1, 0), value=NO_KEY_LEVEL)[:, :, :blocks]
    prev_k = F.pad(phi_k, (0, 0, 0, 0, 1, 0))[:, :, :blocks]
    prev_v = F.pad(v_ones, (0, 0, 0, 0, 1, 0))[:, :, :blocks]
    shifted = log_q + level_prev[:, :, :, None, :]
    top = finite_or_zero(shifted.amax(-1)).detach()  # [B, H, C, W]: the far part's log scale
    phi_q_prev = torch.exp(shifted - top[..., None])
    phi_q_prefix = torch.exp(log_q + level_before_prev[:, :, :, None, :] - top[..., None])  # E_(c-2) <= E_(c-1)
    # block c - 1's keys at offsets <= the query's own offset are at positions <= i - W
    lower = torch.ones(w, w, dtype=torch.bool, device=log_q.device).tril()
    cross = torch.einsum("bhcqp,bhckp->bhcqk", phi_q_prev, prev_k) * lower
    far = torch.einsum("bhcqp,bhpce->bhcqe", phi_q_prefix, prefix) + cross @ prev_v
    return far[..., :-1], far[..., -1], top


# -- decoding -------------------------------------------------------------------------------------------------------
def far_sums(log_k: torch.Tensor, v: torch.Tensor, gone: torch.Tensor) -> dict[str, torch.Tensor]:
    """The far state over the keys marked `gone` [B, N] (log-features [B, H, N, P], values [B, H, N, e]):
    kv_sum [B, H, P, e] = Σ exp(b_jp − E_p) v_j, key_sum [B, H, P] = Σ exp(b_jp − E_p), key_level [B, H, P] = E_p,
    the largest b_jp of those keys (NO_KEY_LEVEL when there is none)."""
    log_k = log_k.masked_fill(~gone[:, None, :, None], float("-inf"))
    level = finite_level(log_k.detach().amax(2))
    phi_k = torch.exp(log_k - level[:, :, None, :])
    return {"kv_sum": torch.einsum("bhnp,bhne->bhpe", phi_k, v), "key_sum": phi_k.sum(2), "key_level": level}


def add_far_key(kv_sum, key_sum, key_level, log_k: torch.Tensor, v: torch.Tensor,
                joins: torch.Tensor) -> dict[str, torch.Tensor]:
    """The far state after one key per row (log-features [B, H, P], value [B, H, e]) joins it where `joins` [B]:
    the levels become running maxima and the sums are decayed to them (every factor at most 1)."""
    log_k = log_k.masked_fill(~joins[:, None, None], float("-inf"))
    level = torch.maximum(key_level, log_k.detach())
    decay = torch.exp(key_level - level)
    phi_k = torch.exp(log_k - level)
    return {"kv_sum": kv_sum * decay[..., None] + phi_k[..., None] * v[:, :, None, :],
            "key_sum": key_sum * decay + phi_k, "key_level": level}


def read_far(log_q: torch.Tensor, kv_sum, key_sum, key_level) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(far_num [B, H, T, e], far_den [B, H, T], far_scale [B, H, T]) of queries with log-features [B, H, T, P]
    against the far state, the levels folded into the query side as in the parallel form."""
    shifted = log_q + key_level[:, :, None, :]
    top = finite_or_zero(shifted.amax(-1)).detach()
    phi_q = torch.exp(shifted - top[..., None])
    return phi_q @ kv_sum, torch.einsum("bhtp,bhp->bht", phi_q, key_sum), top

def feature_far_parallel(log_q, log_k, v, n_real, window: int, sinks: int):
    """The far triple of left-aligned queries, (num [B, H, L, e], den [B, H, L], log scale [B, H, L]), from
    `blocked_far_part` with the keys that may be far."""
    length = log_q.shape[2]
    far = blocked_far_part(log_q, log_k, v, far_key_mask(n_real, sinks, length), window)
    return tuple(x.flatten(2, 3)[:, :, :length] for x in far)


def dense_feature_far(log_q, log_k, v, far):
    """The dense reference of a feature far part, no stabilisation: κ_ij = Σ_p exp(a_ip + b_jp) on the far keys
    (`far` [B, L, L]) -> (κ v, Σ κ, log scale 0)."""
    kernel = torch.exp(log_q[:, :, :, None, :] + log_k[:, :, None, :, :]).sum(-1) * far[:, None]
    return kernel @ v, kernel.sum(-1), torch.zeros_like(kernel[..., 0])


class FeatureFarPart(FarPart):
    """A far part whose kernel is κ_ij = Σ_p exp(a_ip + b_jp) with query log-features a = `query_log_features(q)`
    and key log-features b = `key_log_features(k)` ([B, H, N, P], −inf allowed), on the scale of exp(s_ij): the
    blocked parallel form, the decoding sums over the keys that left the window and the dense reference above.
    `constants` is the dict of per-generation constants when decoding (a random feature map keeps its draw there for
    a whole generation, and a prefill's features may add it), else None."""

    def query_log_features(self, q: torch.Tensor, constants: dict | None = None) -> torch.Tensor:
        raise NotImplementedError

    def key_log_features(self, k: torch.Tensor, constants: dict | None = None) -> torch.Tensor:
        raise NotImplementedError

    def parallel(self, x: FarInputs) -> FarOutput:
        constants = {} if x.keep_state else None
        k, v = self.expand_kv(x.k), self.expand_kv(x.v)
        log_k = self.key_log_features(k, constants)
        n_real = x.n_real
        num, den, scale = feature_far_parallel(self.query_log_features(x.q, constants), log_k, v, n_real,
                                               self.window_size, self.sinks)
        if not x.keep_state:
            return FarOutput(num, den, scale)
        # the far keys of each row's last token
        state = far_sums(log_k, v, keys_far_from(n_real - 1, k.shape[2], self.window_size, self.sinks))
        return FarOutput(num, den, scale, state, constants)

    def step(self, x: FarInputs) -> FarOutput:
        leaving_k, leaving_v, joins = x.leaving
        sums = x.state
        log_k = self.key_log_features(self.expand_kv(leaving_k), x.constants).squeeze(2)  # [B, H, P]
        state = add_far_key(sums["kv_sum"], sums["key_sum"], sums["key_level"], log_k,
                            self.expand_kv(leaving_v).squeeze(2), joins)
        far = read_far(self.query_log_features(x.q, x.constants), state["kv_sum"], state["key_sum"],
                       state["key_level"])
        return FarOutput(*far, state)

    def reference(self, x: FarInputs) -> FarOutput:
        k, v = self.expand_kv(x.k), self.expand_kv(x.v)
        return FarOutput(*dense_feature_far(self.query_log_features(x.q), self.key_log_features(k), v, x.far))
