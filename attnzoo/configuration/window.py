"""The window family: exact softmax attention cut to a sliding window plus attention sinks ("Efficient Streaming
Language Models with Attention Sinks", arXiv 2309.17453). Converting a pretrained softmax model into it needs no
training, and keeps a decoding cache of `num_sink_tokens + window_size` tokens per layer whatever the context: the
baseline every conversion into an efficient attention should beat at an equal decode memory budget ("Sliding-window
beats linear attention", arXiv 2608.28444, uses a window of 64 and 4 sinks)."""

from attnzoo.configuration.base import ZooConfig
from attnzoo.validation import check_choice, check_int, check_positive_ints, fail

#: where a query sees the sinks in rotary models (attnzoo/modeling/attention/window.py, `sink_queries`)
SINK_POSITIONS = ("absolute", "adjacent")


class ZooWindowSettings(ZooConfig):
    """The settings of the attentions with a sliding window and sinks: the "window" attention and the near part of
    every windowed layer ("favor_window", "lara_window", "ra_window", "lsh_window", and far parts of one's own). The
    configs of the families that have such an attention include them.

    Args:
        window_size / num_sink_tokens: each query sees the last `window_size` tokens (itself included) and the first
            `num_sink_tokens` tokens of its sequence (StreamingLLM's attention sinks, arXiv 2309.17453), exactly
            (defaults: 64 and 4).
        sink_positions: how a query sees the sinks in rotary models. "absolute" (the default): at their own
            positions, so a query at position p sees them p tokens back, a distance that outgrows the training
            length; "adjacent": as if they came just before its window (distances W .. W + S - 1), StreamingLLM's
            positions within the cache (arXiv 2309.17453, section 3.2), so no distance in the window part ever
            exceeds W + S - 1 and the window part sees at any length only what it saw in training. It can be switched
            on a model trained without it (docs/long_context.md).
    """

    window_size: int = 64
    num_sink_tokens: int = 4
    sink_positions: str = "absolute"

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_positive_ints(self, ("window_size",))
        check_int(self, "num_sink_tokens", 0, "set a non-negative integer (0 = a plain sliding window).")
        check_choice(self, "sink_positions", SINK_POSITIONS)
        if self.sink_positions == "adjacent":
            if self.position_embedding_type != "rotary":
                fail("sink_positions", self.sink_positions, "it moves the sinks' rotary positions, and "
                     f"position_embedding_type={self.position_embedding_type!r}; set position_embedding_type="
                     "'rotary' or sink_positions='absolute'.")
            if not self.num_sink_tokens:
                fail("sink_positions", self.sink_positions, "it places the sinks, and num_sink_tokens=0; set "
                     "num_sink_tokens (e.g. 4) or sink_positions='absolute'.")


class ZooWindowConfig(ZooWindowSettings):
    """Window-with-sinks attention on the shared backbone.

    Args beyond `ZooConfig`: `ZooWindowSettings`' (`window_size`, `num_sink_tokens`, `sink_positions`), and
        attn_layers: "window" layers (or "full" for exact ones, e.g. `["window", "window", "window", "full"]`).
    """

    model_type = "attnzoo_window"

    attn_layers: list[str] | tuple[str, ...] = ("window",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("window",)
