"""The settings of block retrieval, the far part "block" of a windowed layer ("block_window")."""

from __future__ import annotations

from attnzoo.configuration.base import ZooConfig
from attnzoo.validation import check_positive_ints


class ZooBlockRetrievalSettings(ZooConfig):
    """Block retrieval beyond the window (InfLLM, arXiv 2402.04617, §3.2; attnzoo/modeling/attention/block_window.py):
    the far keys in blocks of `block_size` consecutive tokens, each query block reading the `block_topk` blocks whose
    mean key scores highest against its selection query, exactly, beside its window and sinks.

    Args:
        block_size: tokens per far-key block, and queries per query block (default 128, InfLLM's).
        block_topk: blocks each query block reads (default 4); with the keys not yet in a selectable block, a query
            reads at most (block_topk + 2) * block_size far keys, whatever the length.
    """

    block_size: int = 128
    block_topk: int = 4

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_positive_ints(self, ("block_size", "block_topk"))
