"""The decoding cache: a transformers `Cache` whose per-layer slots are chosen by each layer's attention.

Softmax layers hold keys and values (`DynamicLayer`); other attentions bring their own `CacheLayerMixin` (recurrent
state, buckets, ...). Because every slot is a real cache layer, `generate()`, beam-search reordering and
`get_seq_length()` work for any mix of attention kinds.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache


class ZooCache(Cache):
    """One slot per decoder layer, created by `attention.new_cache_layer()`."""

    def __init__(self, layers):
        super().__init__(layers=list(layers))

    @classmethod
    def for_transformer(cls, transformer, max_cache_len: int | None = None) -> ZooCache:
        """The cache of a Transformer's decoder layers: growing slots, or, with `max_cache_len`, static ones (fixed
        shapes and addresses for up to that many positions, so a decode step can be compiled or graph-captured)."""
        return cls(transformer.new_cache_layers(max_cache_len))


def new_encoder_decoder_cache(decoder, max_cache_len: int | None = None) -> EncoderDecoderCache:
    """Self-attention slots from the decoder's attentions (static ones with `max_cache_len`); cross-attention
    keys/values in a `DynamicCache` (written once, at the first step)."""
    return EncoderDecoderCache(ZooCache.for_transformer(decoder, max_cache_len), DynamicCache())


def check_static_capacity(max_cache_len) -> int:
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len={max_cache_len!r} is invalid: pass the number of positions the static cache "
                         "must hold (prompt plus new tokens), a positive int.")
    return max_cache_len


def _fixed_address(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a static slot's tensor as living at one address for the whole generation, so a compiled step reads and
    writes it in place (CUDA graphs included) instead of copying it in as an input (as transformers' StaticLayer)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class SelfManagedCacheLayer(CacheLayerMixin):
    """A cache slot that its attention module fills and reads itself (instead of through `update(keys, values)`).
    It only stores: the attention computes. It counts the positions it has seen, padding included, so
    `get_seq_length()` and the attention mask's length agree and generate() can use it. Beam search and batch
    expansion work on every tensor a subclass lists in `_map`, whose batch dimension comes first."""

    def __init__(self):
        super().__init__()
        self.length = 0

    def _map(self, fn) -> None:
        """Replace every stored tensor t by fn(t)."""
        raise NotImplementedError

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is filled by its attention module, not by update().")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if getattr(self, "device", None) is not None:
            self._map(lambda t: t.to(self.device, non_blocking=True))


def write_at_rows(store: torch.Tensor, index: torch.Tensor, x: torch.Tensor, needed: int) -> torch.Tensor:
    """store [B, h, N, ...] with x [B, h, 1, ...] written at token `index` [B] of each row (along axis 2); `needed` (a
    host number, so no step waits for the device) bounds index + 1. A full store grows to `needed` plus a few spare
    tokens (`spare_tokens`; new slots are zeros), so a decoding step copies the store once every N / SPARE_FRACTION
    steps, not at each. The write is in place: a decoding step's cost is then its own token's, not the store's
    (at 32K tokens a clone of the far keys and values was most of an `lsh_window` step). A store that autograd
    recorded (decoding with gradients) or an inference tensor outside inference mode is copied first, so that a
    graph's saved tensors are never changed."""
    rows = index.view(-1, 1, 1, *([1] * (store.dim() - 3))).expand(-1, store.shape[1], 1, *store.shape[3:])
    if needed > store.shape[2]:
        store = with_room(store, needed)
    elif store.requires_grad or (store.is_inference() and not torch.is_inference_mode_enabled()):
        store = store.clone()
    return store.scatter_(2, rows, x)


class RecurrentStateLayer(SelfManagedCacheLayer):
    """A cache slot for attentions that decode from a fixed-size state instead of stored keys and values
    (linear attention's S and z, say). `state` holds tensors with a leading batch dimension, which beam search
    reorders; `shared` holds per-sequence constants without one (e.g. the random projection used at prefill, so a
    whole generation uses one projection). A recurrent state cannot be rolled back, so it cannot be cropped."""

    is_croppable = False

    def __init__(self):
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.shared: dict[str, torch.Tensor] = {}

    def store(self, new_tokens: int, **tensors: torch.Tensor) -> None:
        self.state.update(tensors)
        self.length += new_tokens
        self.is_initialized = True

    def reset(self) -> None:
        self.state, self.shared, self.length = {}, {}, 0

    def _map(self, fn) -> None:
        self.state = {name: fn(t) for name, t in self.state.items()}


#: A token buffer's spare room when it grows, as a fraction of what it holds (at least `MIN_SPARE_TOKENS`, where a
#: buffer is short and its copy cheap). The buffer is then copied once every capacity / 512 steps (on average 512
#: token rows a step, whatever the length, instead of the whole buffer), and holds at most 0.4% more than its tokens
#: from 1,024 tokens on: a KV cache holds them exactly, and `lsh_window`'s bucket index already takes up to 4.7 of the
#: 5% over a KV cache its state may hold (doubling would hold up to twice the tokens).
SPARE_FRACTION = 512
MIN_SPARE_TOKENS = 4


def spare_tokens(capacity: int) -> int:
    """The spare tokens a buffer holding `capacity` gets when it grows."""
    return max(MIN_SPARE_TOKENS, capacity // SPARE_FRACTION)


def with_room(store: torch.Tensor, needed: int, dim: int = 2) -> torch.Tensor:
    """`store` itself when it holds `needed` tokens along `dim`, else a copy grown to `needed` plus `spare_tokens`
    (new slots are zeros): the one growth rule of every decoding store."""
    if needed <= store.shape[dim]:
        return store
    return _grown(store, needed + spare_tokens(store.shape[dim]), dim)


def with_spare_tokens(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """x in a new buffer with 1 / SPARE_FRACTION of its tokens as zero slots after them along `dim`: a prefill's
    store, so that the first decoding steps do not copy a long one whole (and no view keeps the prefill's larger
    tensors alive). A short one (under SPARE_FRACTION tokens, whose copy is cheap) stays exact until it grows."""
    return _grown(x, x.shape[dim] + prefill_spare_tokens(x.shape[dim]), dim)


def prefill_spare_tokens(tokens: int) -> int:
    """The spare tokens a prefill's store of `tokens` gets (`with_spare_tokens`)."""
    return tokens // SPARE_FRACTION


class TokenBufferLayer(SelfManagedCacheLayer):
    """A cache slot holding per-token tensors of every cached position (keys, values, buckets, validity, ...) in
    buffers along each tensor's token axis, sized to the prefill and grown by a few percent (`SPARE_FRACTION`) when
    full, and per-sequence tensors (e.g. hash rotations).
    Its attention writes and reads it; cropping (assisted decoding) truncates. Per-sequence tensors named in
    `derived_from_tokens` are indexes over the tokens: cropping drops them and the attention rebuilds them."""

    is_croppable = True

    def __init__(self, derived_from_tokens: tuple[str, ...] = ()):
        super().__init__()
        self.buffers: dict[str, torch.Tensor] = {}
        self.start_length = 0  # tokens of the prefill
        self.token_dims: dict[str, int] = {}
        self.sequence: dict[str, torch.Tensor] = {}
        self.derived_from_tokens = tuple(derived_from_tokens)

    def start(self, tokens: dict[str, tuple[torch.Tensor, int]], **sequence: torch.Tensor) -> None:
        """Fill the slot after a prefill: `tokens` maps a name to (tensor, its token axis)."""
        first, dim = next(iter(tokens.values()))
        self.lazy_initialization(first, first)
        self.length = self.start_length = first.shape[dim]
        capacity = self.length + prefill_spare_tokens(self.length)  # the first steps do not copy a long prefill
        self.token_dims = {name: dim for name, (_, dim) in tokens.items()}
        self.buffers = {name: _grown(x.detach(), capacity, dim) for name, (x, dim) in tokens.items()}
        self.sequence = dict(sequence)

    def append(self, **tokens: torch.Tensor) -> None:
        """Add new tokens (each tensor holds the same number of them along its token axis)."""
        name, first = next(iter(tokens.items()))
        count = first.shape[self.token_dims[name]]
        self.buffers = {n: with_room(b, self.length + count, self.token_dims[n]) for n, b in self.buffers.items()}
        for name, x in tokens.items():
            self.buffers[name].narrow(self.token_dims[name], self.length, count).copy_(x.detach())
        self.length += count

    def tokens(self, name: str) -> torch.Tensor:
        """The stored `name` of every cached token (a view of the buffer)."""
        return self.buffers[name].narrow(self.token_dims[name], 0, self.length)

    def written_tokens(self, name: str) -> torch.Tensor:
        """The stored `name` of every cached token, exactly (outside a decode step: a static slot reads its count)."""
        return self.tokens(name)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -n tokens for n = `tokens_to_remove` < 0, as transformers' cache layers do (a positive
        value, the legacy "final size", is refused there and here). Assisted decoding passes a 0-d tensor on some
        transformers releases (5.17): it is read as an int, so `length` never becomes a tensor that later updates
        would alias."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        if self.length == 0 or tokens_to_remove == 0:
            return
        self.length = max(self.length + tokens_to_remove, 0)
        for name in self.derived_from_tokens:
            self.sequence.pop(name, None)

    def reset(self) -> None:
        self.length = 0
        self.buffers, self.sequence = {}, {}
        self.is_initialized = False

    def _map(self, fn) -> None:
        self.buffers = {name: fn(b) for name, b in self.buffers.items()}
        self.sequence = {name: fn(t) for name, t in self.sequence.items()}


class StaticSlot:
    """What the static slots share (mixed in before their growing counterpart): a capacity of `max_cache_len`
    positions, the count of cached positions as a 0-d tensor on the slot's device (as transformers' `StaticLayer`
    keeps it), so that no decode step reads a host value that changes, and beam reordering in place, so that a
    compiled step (a CUDA graph) keeps the addresses it was built on."""

    is_compileable = True

    def _set_capacity(self, max_cache_len) -> None:
        self.max_cache_len = check_static_capacity(max_cache_len)
        self.written = torch.zeros((), dtype=torch.long)

    def _start_count(self, count: int, device) -> None:
        self.written = _fixed_address(torch.full((), count, dtype=torch.long, device=device))

    def get_seq_length(self) -> torch.Tensor | int:
        return self.written if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def reset(self) -> None:
        super().reset()
        self.written = torch.zeros((), dtype=torch.long)
        self.is_initialized = False

    @staticmethod
    def _map_in_place(group: dict[str, torch.Tensor], fn) -> None:
        """Replace every tensor t of `group` by fn(t): in place where the shape stays (beam reordering), else (batch
        expansion, before decoding starts) by a new fixed-address tensor."""
        for name, t in group.items():
            mapped = fn(t)
            if mapped.shape == t.shape:
                t.copy_(mapped)
            else:
                group[name] = _fixed_address(mapped)


class StaticRecurrentStateLayer(StaticSlot, RecurrentStateLayer):
    """A `RecurrentStateLayer` for compiled and graph-captured decoding: the state is allocated by the prefill and
    then updated in place (fixed shapes and addresses). `max_cache_len` bounds the positions (and the attention
    mask's columns), not the state, whose size never depends on the length."""

    def __init__(self, max_cache_len: int):
        super().__init__()
        self._set_capacity(max_cache_len)

    def store(self, new_tokens: int, **tensors: torch.Tensor) -> None:
        if not self.state:  # the prefill: the state's shapes and device are known from here on
            self.state = {name: _fixed_address(t.detach().clone(memory_format=torch.contiguous_format))
                          for name, t in tensors.items()}
            self._start_count(new_tokens, next(iter(tensors.values())).device)
            self.is_initialized = True
            return
        for name, t in tensors.items():
            self.state[name].copy_(t)
        self.written.add_(new_tokens)

    def _map(self, fn) -> None:
        self._map_in_place(self.state, fn)


class StaticTokenBufferLayer(StaticSlot, TokenBufferLayer):
    """A `TokenBufferLayer` for compiled and graph-captured decoding: buffers of `max_cache_len` positions allocated
    by the prefill, new tokens written in place at the position count. `tokens()` returns the whole buffer:
    attentions read it by index, clamped to the written positions, and mask what lies beyond them."""

    def __init__(self, max_cache_len: int, derived_from_tokens: tuple[str, ...] = ()):
        super().__init__(derived_from_tokens)
        self._set_capacity(max_cache_len)

    def start(self, tokens: dict[str, tuple[torch.Tensor, int]], **sequence: torch.Tensor) -> None:
        first, dim = next(iter(tokens.values()))
        if first.shape[dim] > self.max_cache_len:
            raise ValueError(f"the prompt has {first.shape[dim]} positions but the static cache holds "
                             f"max_cache_len={self.max_cache_len}; build the cache with a larger max_cache_len.")
        self.lazy_initialization(first, first)
        self.length = self.start_length = first.shape[dim]
        self._start_count(self.length, first.device)
        self.token_dims = {name: dim for name, (_, dim) in tokens.items()}
        self.buffers = {name: _fixed_address(_grown(x.detach(), self.max_cache_len, dim))
                        for name, (x, dim) in tokens.items()}
        # Own, dense copies (a per-sequence tensor may be an expanded view), which beam search reorders in place.
        self.sequence = {name: _fixed_address(t.detach().clone(memory_format=torch.contiguous_format))
                         for name, t in sequence.items()}

    def append(self, **tokens: torch.Tensor) -> None:
        """Write new tokens at the position count (the model refuses, in eager mode, a forward that would write past
        `max_cache_len`)."""
        name, first = next(iter(tokens.items()))
        count = first.shape[self.token_dims[name]]
        index = self.written + torch.arange(count, device=self.written.device)
        for name, x in tokens.items():
            self.buffers[name].index_copy_(self.token_dims[name], index, x.detach())
        self.written.add_(count)

    def tokens(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def written_tokens(self, name: str) -> torch.Tensor:
        return self.buffers[name].narrow(self.token_dims[name], 0, int(self.written))

    def crop(self, tokens_to_remove: int) -> None:
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        if not self.is_initialized or tokens_to_remove == 0:
            return
        self.written.clamp_(min=-tokens_to_remove).add_(tokens_to_remove)
        for name in self.derived_from_tokens:
            self.sequence.pop(name, None)

    def _map(self, fn) -> None:
        self._map_in_place(self.buffers, fn)
        self._map_in_place(self.sequence, fn)


def _grown(x: torch.Tensor, capacity: int, dim: int) -> torch.Tensor:
    """x copied into a buffer of `capacity` along `dim` (the tail is unused space)."""
    shape = list(x.shape)
    shape[dim] = capacity
    buffer = x.new_zeros(shape)
    buffer.narrow(dim, 0, x.shape[dim]).copy_(x)
    return buffer


# -- torch.export support ---------------------------------------------------------------------------------------
# A forward in evaluation mode returns its ZooCache; torch.export must know how to take it apart into tensors and put
# it back together. The cache's layers differ by attention kind, so their attributes are walked generically: tensors
# become leaves, everything else (ints, dtypes, devices, layer classes) goes into the context.

def _flatten_value(value, leaves: list):
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("tensor",)
    if isinstance(value, dict):
        return ("dict", tuple((key, _flatten_value(item, leaves)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return (type(value), tuple(_flatten_value(item, leaves) for item in value))
    if isinstance(value, CacheLayerMixin):
        return ("layer", type(value), tuple((key, _flatten_value(item, leaves)) for key, item in vars(value).items()))
    return ("constant", value)


def _unflatten_value(spec, leaves):
    kind = spec[0]
    if kind == "tensor":
        return next(leaves)
    if kind == "dict":
        return {key: _unflatten_value(item, leaves) for key, item in spec[1]}
    if kind == "layer":
        layer = spec[1].__new__(spec[1])
        for key, item in spec[2]:
            setattr(layer, key, _unflatten_value(item, leaves))
        return layer
    if kind == "constant":
        return spec[1]
    return kind(_unflatten_value(item, leaves) for item in spec[1])  # a list or tuple


def _flatten_cache(cache: ZooCache):
    leaves = []
    context = tuple((key, _flatten_value(value, leaves)) for key, value in vars(cache).items())
    return leaves, context


def _flatten_cache_with_keys(cache: ZooCache):
    leaves, context = _flatten_cache(cache)
    return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], context


def _unflatten_cache(values, context) -> ZooCache:
    leaves = iter(values)
    cache = ZooCache.__new__(ZooCache)
    for key, spec in context:
        setattr(cache, key, _unflatten_value(spec, leaves))
    return cache


try:
    pytree.register_pytree_node(ZooCache, _flatten_cache, _unflatten_cache, serialized_type_name=f"{__name__}.ZooCache",
                                flatten_with_keys_fn=_flatten_cache_with_keys)
except ValueError:  # already registered (the module was imported twice, e.g. as remote code)
    pass
