"""The settings of block retrieval, the far part "block" of a windowed layer ("block_window")."""

from __future__ import annotations

from attnzoo.configuration.base import ZooConfig
from attnzoo.validation import check_int, check_positive_ints, fail

#: the bit widths of a quantised far store (attnzoo.modeling.attention.kv_quantisation.STORE_BITS; the configuration
#: imports nothing of the models)
STORED_BITS = (8, 4)


class ZooBlockRetrievalSettings(ZooConfig):
    """Block retrieval beyond the window (InfLLM, arXiv 2402.04617, §3.2; attnzoo/modeling/attention/block_window.py):
    the far keys in blocks of `block_size` consecutive tokens, each query block reading the `block_topk` blocks whose
    mean key scores highest against its selection query, exactly, beside its window and sinks.

    Args:
        block_size: tokens per far-key block (default 128, InfLLM's).
        block_topk: blocks each query block reads (default 4); with the keys not yet in a selectable block, a query
            reads at most (block_topk + 2) * block_size far keys, whatever the length.
        block_query_size: queries per query block, the queries that share one selection (None: `block_size`); a
            divisor of `block_size`. A query block selects with its first query and the `block_size` queries before
            it, so a smaller one selects with later tokens (a question at the end of a prompt selects for the
            answer's first token) at the cost of gathering the chosen keys once per smaller block.
        block_key_bits, block_value_bits: the far keys (values) a decoding step keeps, and the full forward reads,
            in 8 or 4 bits an entry, with one scale and offset per token and head (`kv_quantisation`); None keeps
            them as computed. The window and sinks stay exact. With head_dim 64 in float32, 8-bit keys and 4-bit
            values hold the far store in 0.22x the bytes of a float32 KV cache.
    """

    block_size: int = 128
    block_topk: int = 4
    block_query_size: int | None = None
    block_key_bits: int | None = None
    block_value_bits: int | None = None

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_positive_ints(self, ("block_size", "block_topk"))
        fix = f"set a divisor of block_size={self.block_size}, or None for block_size."
        check_int(self, "block_query_size", 1, fix, optional=True)
        if self.block_query_size is not None and self.block_size % self.block_query_size:
            fail("block_query_size", self.block_query_size, fix)
        layers = {*self.attn_layers, *(self.decoder_attn_layers if self.is_encoder_decoder else ())}
        for field in ("block_key_bits", "block_value_bits"):
            bits = getattr(self, field)
            if bits is not None and (type(bits) is not int or bits not in STORED_BITS):
                fail(field, bits, f"use one of {STORED_BITS} bits an entry, as an int, or None to keep them as "
                                  "computed.")
            if bits is not None and "block_window" not in layers:  # else a store the user set would be ignored
                fail(field, bits, "it stores block retrieval's far keys and values, and no layer has block retrieval; "
                                  "list 'block_window' in attn_layers or set it to None.")
            if bits == 4 and self.head_dim % 2:
                fail(field, bits, f"4-bit entries pack two a byte and head_dim={self.head_dim} is odd: use 8 bits.")
