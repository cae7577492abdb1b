"""The Performer family: FAVOR+ random-feature attention (and the elu+1 linear kernel) in the shared backbone."""

from attnzoo.configuration.base import ZooConfig


class ZooPerformerConfig(ZooConfig):
    """Performer (Choromanski et al., 2021) on the shared backbone.

    Args beyond `ZooConfig`:
        attn_layers / decoder_attn_layers: "favor" (FAVOR+) or "elu" (elu+1), or "full" for exact layers.
        num_random_features: m, features per head (the paper's default is 256).
        feature_map: "positive" (FAVOR+) or "hyperbolic" (2m features, lower variance).
        orthogonal_features: block-orthogonal projections (with the QR sign fix) instead of i.i.d. Gaussian.
        feature_norm: row lengths of orthogonal projections: "chi" (unbiased) or "sqrt_d".
        feature_redraw: "every_step", "interval" (every `feature_redraw_interval` training forwards) or "fixed".
        elu_alpha: α of the elu+1 map (1 in the paper; seed 003 writes 0.1).
        linear_attention_chunk_size: chunk length of the causal form (memory O(N·chunk)).
    """

    model_type = "attnzoo_performer"

    attn_layers: list[str] | tuple[str, ...] = ("favor",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("favor",)
    num_random_features: int = 256
    feature_map: str = "positive"
    orthogonal_features: bool = True
    feature_norm: str = "chi"
    feature_redraw: str = "every_step"
    feature_redraw_interval: int = 1000
    elu_alpha: float = 1.0
    linear_attention_chunk_size: int = 64

    def check_values(self) -> None:
        super().check_values()
        if self.linear_attention_chunk_size < 1:
            raise ValueError(f"linear_attention_chunk_size={self.linear_attention_chunk_size} is invalid: set a "
                             "positive chunk length (64 is a good default).")
