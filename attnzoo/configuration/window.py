"""The window family: exact softmax attention cut to a sliding window plus attention sinks ("Efficient Streaming
Language Models with Attention Sinks", arXiv 2309.17453). Converting a pretrained softmax model into it needs no
training, and keeps a decoding cache of `num_sink_tokens + window_size` tokens per layer whatever the context: the
baseline every conversion into an efficient attention should beat at an equal decode memory budget ("Sliding-window
beats linear attention", arXiv 2608.28444, uses a window of 64 and 4 sinks)."""

from attnzoo.configuration.base import ZooConfig
from attnzoo.validation import check_int, check_positive_ints


class ZooWindowSettings(ZooConfig):
    """The settings of the attentions with a sliding window and sinks: the "window" attention and the near part of
    every windowed layer ("favor_window", "lara_window", "ra_window", "lsh_window", and far parts of one's own). The
    configs of the families that have such an attention include them.

    Args:
        window_size / num_sink_tokens: each query sees the last `window_size` tokens (itself included) and the first
            `num_sink_tokens` tokens of its sequence (StreamingLLM's attention sinks, arXiv 2309.17453), exactly
            (defaults: 64 and 4).
    """

    window_size: int = 64
    num_sink_tokens: int = 4

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_positive_ints(self, ("window_size",))
        check_int(self, "num_sink_tokens", 0, "set a non-negative integer (0 = a plain sliding window).")


class ZooWindowConfig(ZooWindowSettings):
    """Window-with-sinks attention on the shared backbone.

    Args beyond `ZooConfig`: `ZooWindowSettings`' (`window_size`, `num_sink_tokens`), and
        attn_layers: "window" layers (or "full" for exact ones, e.g. `["window", "window", "window", "full"]`).
    """

    model_type = "attnzoo_window"

    attn_layers: list[str] | tuple[str, ...] = ("window",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("window",)
