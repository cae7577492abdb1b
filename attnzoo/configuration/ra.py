"""The RA family: randomized attention ("Linear Complexity Randomized Self-attention Mechanism", Zheng, Wang and
Kong, ICML 2022, arXiv 2204.04667, §3) in the shared backbone."""

from attnzoo.configuration.sampling import ZooSamplingSettings
from attnzoo.configuration.window import ZooWindowSettings
from attnzoo.validation import check_choice, check_positive_ints

RA_VARIANTS = ("unbiased", "biased")


class ZooRASettings(ZooSamplingSettings):
    """The settings of Randomized Attention ("ra", and RA as the far part of "ra_window"; the estimator:
    docs/random_feature_attention.md).

    Args:
        ra_variant: "unbiased" (exact mixture sampling; at evaluation the index is still sampled, from draws seeded
            by `eval_seed`) or "biased" (Eq. 31; deterministic at evaluation).
        ra_num_samples: draws of ω averaged per query (1 in the paper).
        sample_noise_std: σ of the sampling noise: "paper" (1.0, exactly unbiased), "official" (d**-0.25, what the
            official code does) or a number.
    """

    ra_variant: str = "unbiased"
    ra_num_samples: int = 1

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_choice(self, "ra_variant", RA_VARIANTS)
        check_positive_ints(self, ("ra_num_samples",))


class ZooRAConfig(ZooRASettings, ZooWindowSettings):
    """Randomized Attention (RA) on the shared backbone.

    Args beyond `ZooConfig`: `ZooRASettings`', `ZooWindowSettings`' (the window of "ra_window"), and
        attn_layers: "ra" layers (or "full"). decoder_attn_layers: the decoder of an encoder-decoder model, exact
            softmax by default (the paper replaces only the encoder's self-attention, §5.4).
    """

    model_type = "attnzoo_ra"

    attn_layers: list[str] | tuple[str, ...] = ("ra",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("full",)
