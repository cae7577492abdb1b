"""The RA family: randomized attention (seed 002 §3) in the shared backbone."""

from attnzoo.configuration.base import ZooConfig


class ZooRAConfig(ZooConfig):
    """Randomized Attention (Zheng et al., 2022) on the shared backbone.

    Args beyond `ZooConfig`:
        attn_layers: "ra" layers (or "full"). decoder_attn_layers: the decoder of an encoder-decoder model, exact
            softmax by default (seed 002 §5.4 replaces only the encoder's self-attention).
        ra_variant: "unbiased" (exact mixture sampling; the index is still sampled at evaluation) or "biased"
            (Eq. 31; deterministic at evaluation).
        ra_num_samples: draws of ω averaged per query (1 in the paper).
        sample_noise_std: σ of the sampling noise: "paper" (1.0, exactly unbiased), "official" (d**-0.25, what the
            official code does) or a number.
    """

    model_type = "attnzoo_ra"

    attn_layers: list[str] | tuple[str, ...] = ("ra",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("full",)
    ra_variant: str = "unbiased"
    ra_num_samples: int = 1
    sample_noise_std: str | float = "paper"
