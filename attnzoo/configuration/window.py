"""The window family: exact softmax attention cut to a sliding window plus attention sinks ("Efficient Streaming
Language Models with Attention Sinks", arXiv 2309.17453). Converting a pretrained softmax model into it needs no
training, and keeps a decoding cache of `num_sink_tokens + window_size` tokens per layer whatever the context: the
baseline every conversion into an efficient attention should beat at an equal decode memory budget ("Sliding-window
beats linear attention", arXiv 2608.28444, uses a window of 64 and 4 sinks)."""

from attnzoo.configuration.base import ZooConfig


class ZooWindowConfig(ZooConfig):
    """Window-with-sinks attention on the shared backbone.

    Args beyond `ZooConfig`:
        attn_layers: "window" layers (or "full" for exact ones, e.g. `["window", "window", "window", "full"]`).
        window_size / num_sink_tokens: each query sees the last `window_size` tokens and the first
            `num_sink_tokens` tokens, exactly (defaults: 64 and 4).
    """

    model_type = "attnzoo_window"

    attn_layers: list[str] | tuple[str, ...] = ("window",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("window",)
