"""The Performer family: FAVOR+ random-feature attention ("Rethinking Attention with Performers", Choromanski et
al., ICLR 2021, arXiv 2009.14794) and the elu+1 linear kernel ("Transformers are RNNs", Katharopoulos et al., ICML
2020, arXiv 2006.16236) in the shared backbone."""

from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.window import ZooWindowSettings
from attnzoo.validation import check_choice, check_positive_ints, fail

FEATURE_MAPS = ("positive", "hyperbolic")
FEATURE_NORMS = ("chi", "sqrt_d")
REDRAW_POLICIES = ("every_step", "interval", "fixed", "learned")


class ZooPerformerSettings(ZooConfig):
    """The settings of the Performer family's attentions ("favor", "elu", and FAVOR+ as the far part of
    "favor_window"): feature maps, stabilisation and the exact causal forms are in docs/random_feature_attention.md.

    Args:
        num_random_features: m, features per head. Default: round(d · ln d) for the head size d (d = 64: 266, close
            to the paper's 256; d = 16: 44). The estimator's error falls as m grows relative to d ln d (Performer's
            Theorem 4, arXiv 2009.14794, §4), and the cost grows with m whatever d is, so a fixed 256 made small
            heads pay for features they do not need (a 64-wide, 4-head layer at 257 tokens took 7.2x softmax's
            time with 256 features, 1.2x with 64). performer-pytorch uses the same d · ln d default.
        feature_map: "positive" (FAVOR+) or "hyperbolic" (2m features, lower variance).
        orthogonal_features: block-orthogonal projections (with the QR sign fix) instead of i.i.d. Gaussian.
        feature_norm: row lengths of orthogonal projections: "chi" (unbiased) or "sqrt_d".
        feature_redraw: "every_step", "interval" (every `feature_redraw_interval` training forwards), "fixed", or
            "learned": the projection is a parameter, drawn once as "fixed" and then trained (a learnable feature
            map, as the linearizers fit one by attention transfer: "Hedgehog", arXiv 2402.04347; "LoLCATs", arXiv
            2410.10254). Its features stay positive, but no longer estimate exp(q·k) without bias.
        elu_alpha: α of the elu+1 map, elu(x) + 1 with elu's α (1 is the usual map; any α in (0, 1] keeps it positive).
        linear_attention_chunk_size: chunk length of the causal form (memory O(N·chunk)).
    """

    num_random_features: int | None = None
    feature_map: str = "positive"
    orthogonal_features: bool = True
    feature_norm: str = "chi"
    feature_redraw: str = "every_step"
    feature_redraw_interval: int = 1000
    elu_alpha: float = 1.0
    linear_attention_chunk_size: int = 64

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_choice(self, "feature_map", FEATURE_MAPS)
        check_choice(self, "feature_norm", FEATURE_NORMS)
        check_choice(self, "feature_redraw", REDRAW_POLICIES)
        check_positive_ints(self, ("num_random_features", "feature_redraw_interval", "linear_attention_chunk_size"))
        if not 0.0 < self.elu_alpha <= 1.0:
            fail("elu_alpha", self.elu_alpha, "elu(x) + 1 stays positive only for 0 < alpha <= 1.")


class ZooPerformerConfig(ZooPerformerSettings, ZooWindowSettings):
    """Performer on the shared backbone.

    Args beyond `ZooConfig`: `ZooPerformerSettings`' (the features), `ZooWindowSettings`' (the window of
    "favor_window"), and
        attn_layers / decoder_attn_layers: "favor" (FAVOR+), "elu" (elu+1) or "favor_window" (decoders), or "full"
            for exact layers.
    """

    model_type = "attnzoo_performer"

    attn_layers: list[str] | tuple[str, ...] = ("favor",)
    decoder_attn_layers: list[str] | tuple[str, ...] = ("favor",)
