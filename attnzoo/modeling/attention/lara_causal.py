"""Causal LARA: this project's extension of LARA to decoders (no published implementation exists: the paper, arXiv
2204.04667, and its official code use LARA only in encoders). The derivation is in docs/random_feature_attention.md,
"Causal LARA".

The sequence is cut into chunks of `lara_chunk_size`; the proposal built from chunk b (its landmarks, Eq. 34)
becomes available to queries in later chunks, next to a prior proposal μ_0 = 0 that is always available; the balance
heuristic and the query-specific weights run over the available proposals only (normalised over proposals), and f
sums over keys m ≤ n. Written as linear attention whose features are the proposals, it runs in the chunked causal
form (training; `attnzoo.ops.decayed_linear_attention`, keys stabilised by their running maximum) and, for decoding,
from a recurrent state (per-proposal prefix sums). Cost: O(N · N/chunk) time and
memory, so a chunk of 64 makes it ~64x cheaper than softmax attention, but not linear.
"""

from __future__ import annotations

import torch
from torch import nn

from attnzoo.modeling.attention.base import check_attention_mask, static_key_mask
from attnzoo.modeling.attention.lara_base import LARABase
from attnzoo.modeling.attention.random_features import log_features_at, running_max_key_features
from attnzoo.modeling.cache import RecurrentStateLayer, StaticRecurrentStateLayer, write_at_rows
from attnzoo.ops.decayed_linear_attention import decayed_linear_attention

ALPHA_FLOOR = 1e-8  # the official code's clamp: the query-specific correction can make α negative


class CausalLARATerms:
    """The causal estimator's features: `_causal_terms` (the parallel form's) and `_weights` (a decoding step's),
    over `LARASettings` (chunk size, weighting, landmark transforms `landmark_q`/`landmark_k`, draws). Used by
    `CausalLARA` and by the windowed layer's LARA far part."""

    def _causal_terms(self, q, k, v, n_real):
        """Features of the chunk-causal form for left-aligned q, k, v [B, H, N, d] with n_real real tokens per row:
        log query weights log a [B, H, N, P] and log key features [B, H, N, P] over P = 1 + chunks proposals,
        with the proposals themselves (ω, μ, query landmarks), as a dict."""
        batch, heads, length, dim = q.shape
        chunk = self.chunk_size
        chunks = -(-length // chunk)
        pad = chunks * chunk - length
        scale = dim ** -0.25
        token_valid = torch.arange(length, device=q.device)[None, :] < n_real[:, None]
        weights = nn.functional.pad(token_valid.to(q.dtype), (0, pad)).view(batch, 1, chunks, chunk, 1)
        count = weights.sum(3).clamp(min=1)

        def chunk_mean(x):
            x = nn.functional.pad(x, (0, 0, 0, pad)).view(batch, heads, chunks, chunk, dim)
            return (x * weights).sum(3) / count

        q_bar = chunk_mean(self._transform(self.landmark_q, q)) * scale
        k_bar = chunk_mean(self._transform(self.landmark_k, k)) * scale
        zeros = q.new_zeros(batch, heads, 1, dim)  # the prior proposal μ_0 = 0 (and its query landmark)
        mu = torch.cat([zeros, q_bar + k_bar], dim=2)
        q_bar = torch.cat([zeros, q_bar], dim=2)
        omega = self._draw(mu)
        q_hat, k_hat = q * scale, k * scale
        log_q = log_features_at(q_hat, omega)
        log_k = log_features_at(k_hat, omega).masked_fill(~token_valid[:, None, :, None], float("-inf"))
        log_density = log_features_at(mu, omega).transpose(-1, -2)  # G[p, p'] = log q̃_p'(ω_p)
        own = torch.diagonal(log_density, dim1=-2, dim2=-1)  # [B, H, P]
        query_chunk = torch.arange(length, device=q.device) // chunk  # proposals 0..j are available in chunk j
        available = torch.arange(chunks + 1, device=q.device)[None, :] <= query_chunk[:, None]  # [N, P]
        # Balance heuristic over the available proposals: a running log-sum-exp over p' ≤ j.
        running = torch.logcumsumexp(log_density, dim=-1)  # [B, H, P(sample), P(prefix end)]
        log_balance = own.unsqueeze(-2) - running.transpose(-1, -2).index_select(2, query_chunk)  # [B, H, N, P]
        # Mask before exp: an unavailable proposal's value can overflow, and inf would turn its zero gradient NaN.
        alpha = log_balance.masked_fill(~available, float("-inf")).exp()
        if self.weighting == "query_specific":
            logits = (q_hat @ q_bar.transpose(-1, -2)).masked_fill(~available, float("-inf"))
            r = logits.softmax(-1)
            alpha = alpha + self.alpha_coeff * (r - 1.0 / (query_chunk[:, None] + 1))
        log_alpha = alpha.clamp(min=ALPHA_FLOOR).log().masked_fill(~available, float("-inf"))
        return {"log_a": log_alpha + log_q - own.unsqueeze(-2), "log_k": log_k, "omega": omega, "mu": mu,
                "q_bar": q_bar, "token_valid": token_valid}

    def _landmark_proposal(self, q_sum, k_sum):
        """(ω, μ, q̄) of the proposal a completed chunk gives (Eq. 34), from its landmark sums [..., d]."""
        scale = self.head_dim ** -0.25
        q_bar = q_sum / self.chunk_size * scale
        mu = q_bar + k_sum / self.chunk_size * scale
        return self._draw(mu), mu, q_bar

    def _weights(self, q_hat, omega, mu, q_bar, available):
        """log a [B, H, T, P] for queries q̂ [B, H, T, d] given the proposals available to each (bool [B, T, P])."""
        log_q = log_features_at(q_hat, omega)
        log_density = log_features_at(mu, omega).transpose(-1, -2).unsqueeze(2)  # [B, H, 1, P, P]
        log_density = log_density.masked_fill(~available[:, None, :, None, :], float("-inf"))
        own = torch.diagonal(log_features_at(mu, omega), dim1=-2, dim2=-1).unsqueeze(2)  # [B, H, 1, P]
        alpha = (own - torch.logsumexp(log_density, dim=-1)).masked_fill(~available[:, None], float("-inf")).exp()
        if self.weighting == "query_specific":
            logits = (q_hat @ q_bar.transpose(-1, -2)).masked_fill(~available[:, None], float("-inf"))
            count = available.sum(-1)[:, None, :, None]
            alpha = alpha + self.alpha_coeff * (logits.softmax(-1) - 1.0 / count)
        log_alpha = alpha.clamp(min=ALPHA_FLOOR).log().masked_fill(~available[:, None], float("-inf"))
        return log_alpha + log_q - own


class CausalLARA(CausalLARATerms, LARABase):
    """Causal LARA over `LARABase`'s settings, landmark transforms and draws. The registered "lara"
    (`lara.LinearRandomizedAttention`) uses it in decoder layers and the paper's `lara.BidirectionalLARA`, which
    shares `LARABase`, in encoders."""

    def _causal(self, hidden_states, attention_mask, layer=None, position_ids=None):
        """The parallel (training) form; with `layer`, also the decoding state after these tokens (a prefill)."""
        q, k, v = self._inputs(hidden_states, position_ids)
        batch, _, length, _ = q.shape
        key_mask = check_attention_mask(attention_mask, batch, length)
        order = None
        if key_mask is not None:  # left-align the real tokens, so chunks count real tokens in every row
            order = torch.argsort((~key_mask).to(torch.int8), dim=-1, stable=True)
            gather = order[:, None, :, None]
            q, k, v = (torch.gather(t, 2, gather.expand_as(t)) for t in (q, k, v))
            n_real = key_mask.sum(-1)
        else:
            n_real = torch.full((batch,), length, device=q.device)
        terms = self._causal_terms(q, k, v, n_real)
        log_a, log_k = terms["log_a"], terms["log_k"]
        # Keys stabilised by their running maximum (no output can depend on a later token), queries by their own
        # maximum over proposals: the exact decayed causal form (docs/random_feature_attention.md, section 2).
        phi_k, running_max = running_max_key_features(log_k, None)
        phi_q = torch.exp(log_a - log_a.amax(-1, keepdim=True).detach())
        out = decayed_linear_attention(phi_q, phi_k, v, running_max, self.chunk_size)
        if layer is not None:
            self._start_state(layer, q, k, v, n_real, terms)
        if order is not None:
            out = torch.empty_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
        return out

    # -- decoding from a recurrent state ----------------------------------------------------------------------
    def new_cache_layer(self):
        return LaraStateLayer()

    def new_static_cache_layer(self, max_cache_len: int):
        return StaticLaraStateLayer(max_cache_len, self.chunk_size)

    def _start_state(self, layer, q, k, v, n_real, terms):
        """The state after a prefill: real keys/values (left-aligned), the proposals of completed chunks and their
        prefix sums over all real keys (relative to each proposal's largest key log-feature, which later tokens
        raise as a running maximum), and the running landmark sums of the unfinished chunk."""
        key_max = terms["log_k"].amax(dim=2, keepdim=True).detach()
        key_max = torch.where(torch.isfinite(key_max), key_max, torch.zeros_like(key_max))
        phi_k = torch.exp(terms["log_k"] - key_max)
        chunk, scale = self.chunk_size, self.head_dim ** -0.25
        token_valid = terms["token_valid"]
        in_partial = token_valid & (torch.arange(q.shape[2], device=q.device)[None, :] >= (n_real // chunk *
                                                                                            chunk)[:, None])
        partial = in_partial[:, None, :, None].to(q.dtype)
        layer.start(n_real, q.shape[2], k_hat=k * scale, v=v, omega=terms["omega"], mu=terms["mu"],
                    q_bar=terms["q_bar"],
                    s=torch.einsum("bhnp,bhne->bhpe", phi_k, v), z=phi_k.sum(2), c=key_max.squeeze(2),
                    q_sum=(self._transform(self.landmark_q, q) * partial).sum(2),
                    k_sum=(self._transform(self.landmark_k, k) * partial).sum(2))

    def causal_forward(self, hidden_states, attention_mask, layer=None, position_ids=None):
        """Causal LARA over new tokens: the parallel form, which also fills an empty cache slot (a prefill), or
        recurrent steps over a filled one."""
        static = isinstance(layer, StaticLaraStateLayer)
        if layer is None or not layer.state:
            if static and attention_mask is not None:  # a static cache's mask covers its capacity: the prompt's part
                attention_mask = static_key_mask(attention_mask, attention_mask.shape[0], layer.max_cache_len)
                attention_mask = attention_mask[:, :hidden_states.shape[1]]
            return self._causal(hidden_states, attention_mask, layer, position_ids)
        # A continuation after the prefill; generate() feeds one token at a time, so this loop is not a hot path.
        past = layer.get_seq_length()
        past = past.clone() if static else past  # a static slot's count moves on in place at every step
        step = self._static_step if static else self._step
        return torch.cat([step(hidden_states[:, t:t + 1], layer,
                               None if position_ids is None else position_ids[:, t:t + 1], past + t)
                          for t in range(hidden_states.shape[1])], 2)

    def _recurrent_update(self, q, k, v, state, position):
        """One new token per row (q, k, v [B, H, 1, d], at real position `position` [B]) over the proposals in
        `state`: every proposal's prefix sums with the new key, rescaled by their running maximum; the output from
        the proposals available to the token; the landmark sums of the unfinished chunk. Returns (output, the new
        s, z, c, q_sum, k_sum)."""
        chunk, scale = self.chunk_size, self.head_dim ** -0.25
        q_hat, k_hat = q * scale, k * scale
        proposals = state["omega"].shape[2]
        available = torch.arange(proposals, device=q.device)[None, :] <= (position // chunk)[:, None]  # [B, P]
        log_k = log_features_at(k_hat, state["omega"]).squeeze(2)  # [B, H, P]
        c = torch.maximum(state["c"], log_k)
        rescale = torch.exp(state["c"] - c)
        s = state["s"] * rescale.unsqueeze(-1) + torch.exp(log_k - c).unsqueeze(-1) * v
        z = state["z"] * rescale + torch.exp(log_k - c)
        log_a = self._weights(q_hat, state["omega"], state["mu"], state["q_bar"], available[:, None, :]).squeeze(2)
        logits = (log_a + c + torch.log(z)).masked_fill(~available[:, None, :], float("-inf"))
        out = (logits.softmax(-1).unsqueeze(-1) * (s / z.unsqueeze(-1))).sum(2, keepdim=True)
        q_sum = state["q_sum"] + self._transform(self.landmark_q, q).squeeze(2)
        k_sum = state["k_sum"] + self._transform(self.landmark_k, k).squeeze(2)
        return out, s, z, c, q_sum, k_sum

    def _step(self, hidden_states, layer, position_ids=None, past: int = 0):
        """One new (real) token per row: update every available proposal's prefix sums, weight the proposals,
        and when a row completes a chunk, add that chunk's proposal with prefix sums over all its keys."""
        q, k, v = self._inputs(hidden_states, position_ids, past)
        position = torch.tensor(layer.counts, device=q.device)
        out, s, z, c, q_sum, k_sum = self._recurrent_update(q, k, v, layer.state, position)
        layer.append_token(k * self.head_dim ** -0.25, v, s=s, z=z, c=c, q_sum=q_sum, k_sum=k_sum)
        finished = [row for row, n in enumerate(layer.counts) if n % self.chunk_size == 0]
        if finished:
            self._add_proposals(layer, finished)
        return out

    def _static_step(self, hidden_states, layer, position_ids=None, past=0):
        """`_step` over a static slot, with tensors only: the key is written in place at the row's count, and the
        proposal of a chunk a row completes is computed under `torch.cond` (the branch runs only at a chunk's end,
        in eager and compiled steps alike) and written into that row's next proposal slot, other rows unchanged."""
        q, k, v = self._inputs(hidden_states, position_ids, past)
        state, chunk = layer.state, self.chunk_size
        position = state["counts"]
        out, s, z, c, q_sum, k_sum = self._recurrent_update(q, k, v, state, position)
        batch, heads, _, dim = k.shape
        state["k_hat"].scatter_(2, position[:, None, None, None].expand(batch, heads, 1, dim), k * dim ** -0.25)
        state["v"].scatter_(2, position[:, None, None, None].expand(batch, heads, 1, v.shape[-1]), v)
        counts = position + 1
        finished = counts % chunk == 0  # [B]
        new = torch.cond(finished.any(), self._chunk_proposal, _no_proposal,
                         (counts, state["k_hat"], state["v"], q_sum, k_sum))
        slot = counts // chunk  # the next proposal slot of a row that finished (unused otherwise)
        fresh = dict(zip(("omega_minus_mu", "mu", "q_bar", "s", "z", "c"), new, strict=True))
        fresh["omega"] = fresh.pop("omega_minus_mu") + fresh["mu"]
        for name, current in {"omega": state["omega"], "mu": state["mu"], "q_bar": state["q_bar"], "s": s, "z": z,
                              "c": c}.items():  # the state's proposals in place, this step's new sums before storing
            index = slot.view(batch, 1, 1, *([1] * (current.dim() - 3))).expand(batch, heads, 1, *current.shape[3:])
            kept = torch.where(finished.view(batch, *([1] * (current.dim() - 1))), fresh[name].unsqueeze(2),
                               current.gather(2, index))
            current.scatter_(2, index, kept)
        keep = ~finished[:, None, None]
        layer.store(1, s=s, z=z, c=c, q_sum=q_sum * keep, k_sum=k_sum * keep, counts=counts)
        return out

    def _chunk_proposal(self, counts, keys, values, q_sum, k_sum):
        """For every row, the proposal of the chunk its last `chunk_size` real tokens form (Eq. 34 from their landmark
        sums) with its prefix sums over the row's `counts` stored keys: (ω - μ, μ, q̄ [B, H, d], s [B, H, e],
        z, c [B, H]). `_static_step` keeps it for the rows that just completed a chunk."""
        omega, mu, q_bar = self._landmark_proposal(q_sum, k_sum)
        valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < counts[:, None]
        log_k = log_features_at(keys, omega.unsqueeze(2)).squeeze(-1).masked_fill(~valid[:, None], float("-inf"))
        c = log_k.amax(-1)
        weights = torch.exp(log_k - c.unsqueeze(-1))
        # ω is returned as ω - μ, added back by the caller: in evaluation the draw is μ itself, and inductor's CUDA
        # code for the branch gave both outputs one buffer even through a clone, with wrong steps after it (an H100,
        # torch 2.11; CPU inductor and aot_eager were right). A difference is never an alias of μ.
        proposal = (omega - mu, mu, q_bar, torch.einsum("bhn,bhne->bhe", weights, values), weights.sum(-1), c)
        # Dense layouts, as `_no_proposal`'s: the two branches' outputs must have the same strides (with one row,
        # some of these would otherwise come out with others).
        return tuple(x.clone(memory_format=torch.contiguous_format) for x in proposal)

    def _add_proposals(self, layer, rows):
        """Proposals for rows that just completed a chunk: Eq. 34 from the chunk's landmarks, with prefix sums over
        every real key so far (O(n·d) once per chunk, from the stored keys)."""
        chunk, state = self.chunk_size, layer.state
        rows_t = torch.tensor(rows, device=state["s"].device)
        omega, mu, q_bar = self._landmark_proposal(state["q_sum"][rows_t], state["k_sum"][rows_t])
        keys, values = state["k_hat"][rows_t], state["v"][rows_t]
        length = torch.tensor([layer.counts[r] for r in rows], device=keys.device)
        valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < length[:, None]
        log_k = log_features_at(keys, omega.unsqueeze(2)).squeeze(-1).masked_fill(~valid[:, None], float("-inf"))
        c = log_k.amax(-1)
        weights = torch.exp(log_k - c.unsqueeze(-1))
        slots = [layer.counts[r] // chunk for r in rows]
        layer.set_proposals(rows, slots, omega=omega, mu=mu, q_bar=q_bar,
                            s=torch.einsum("bhn,bhne->bhe", weights, values), z=weights.sum(-1), c=c)
        for name in ("q_sum", "k_sum"):
            state[name][rows_t] = 0.0


    def causal_reference(self, hidden_states, attention_mask, position_ids=None):
        """The quadratic masked form of the same features (unpadded input only)."""
        q, k, v = self._inputs(hidden_states, position_ids)
        key_mask = check_attention_mask(attention_mask, q.shape[0], q.shape[2])
        if key_mask is not None:
            raise ValueError("the causal reference handles unpadded input only")
        terms = self._causal_terms(q, k, v, torch.full((q.shape[0],), q.shape[2], device=q.device))
        scores = (terms["log_a"].exp() @ terms["log_k"].exp().transpose(-1, -2)).tril()
        return scores @ v / scores.sum(-1, keepdim=True)


def _no_proposal(counts, keys, values, q_sum, k_sum):
    """The branch of `_static_step`'s `torch.cond` where no row completed a chunk: placeholders of the proposal's
    shapes, never kept."""
    batch, heads, _, value_dim = values.shape
    return (q_sum.new_zeros(q_sum.shape), q_sum.new_zeros(q_sum.shape), q_sum.new_zeros(q_sum.shape),
            values.new_zeros(batch, heads, value_dim), q_sum.new_zeros(batch, heads), q_sum.new_zeros(batch, heads))


class LaraStateLayer(RecurrentStateLayer):
    """Causal LARA's decoding state (see `_start_state`), with host-side counts of real tokens per row so that
    chunk completions are known without waiting for the device. Keys and values are kept with a few spare tokens
    (`cache.write_at_rows`), so appending a token does not copy the whole store."""

    def __init__(self):
        super().__init__()
        self.counts: list[int] = []

    def start(self, counts: torch.Tensor, positions: int, **tensors):
        """`counts` [B]: real tokens per row; `positions`: the prefill's length, padding included (what the
        attention mask of the next step covers before the new token)."""
        self.counts = counts.tolist()  # one host copy per prefill; decoding steps then never wait for the device
        self.store(positions, **tensors)

    def write_token(self, k_hat, v) -> None:
        """Writes one token's key and value at each row's count (the store grows by a few spare tokens when full); the
        counts move on."""
        index = torch.tensor(self.counts, device=k_hat.device)
        needed = max(self.counts) + 1
        self.state["k_hat"] = write_at_rows(self.state["k_hat"], index, k_hat, needed)
        self.state["v"] = write_at_rows(self.state["v"], index, v, needed)
        self.counts = [n + 1 for n in self.counts]

    def append_token(self, k_hat, v, **tensors):
        self.write_token(k_hat, v)
        self.store(1, **tensors)

    def set_proposals(self, rows, slots, **tensors):
        needed = max(slots) + 1
        for name, value in tensors.items():
            current = self.state[name]
            if needed > current.shape[2]:
                pad = [0, 0] * (current.dim() - 3) + [0, needed - current.shape[2]]
                current = torch.nn.functional.pad(current, pad)
            current = current.clone()
            current[rows, :, slots] = value
            self.state[name] = current

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.counts = [self.counts[i] for i in beam_idx.tolist()]

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        self.counts = [n for n in self.counts for _ in range(repeats)]

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.counts = [self.counts[i] for i in indices.tolist()]

    def reset(self):
        super().reset()
        self.counts = []


class StaticLaraStateLayer(StaticRecurrentStateLayer):
    """Causal LARA's decoding state in fixed shapes, for compiled and graph-captured decoding: keys and values for
    `max_cache_len` tokens, proposal slots for every chunk they can complete (unfilled ones are never available: a
    token sees proposals 0 .. its position // chunk), and the real-token counts as a [B] tensor in the state (so
    beam search reorders them with it)."""

    def __init__(self, max_cache_len: int, chunk_size: int):
        super().__init__(max_cache_len)
        self.chunk_size = chunk_size

    def start(self, counts: torch.Tensor, positions: int, **tensors):
        proposals = 1 + self.max_cache_len // self.chunk_size
        padded = {}
        for name, value in tensors.items():
            size = self.max_cache_len if name in ("k_hat", "v") else proposals if value.dim() >= 3 else None
            if size is not None and name not in ("q_sum", "k_sum"):
                pad = [0, 0] * (value.dim() - 3) + [0, size - value.shape[2]]
                # an unfilled proposal's running maximum starts at -inf, so its first key sets it (no NaN)
                value = torch.nn.functional.pad(value, pad, value=float("-inf") if name == "c" else 0.0)
            padded[name] = value
        self.store(positions, counts=counts.clone(), **padded)
