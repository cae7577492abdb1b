"""What RA and LARA share among their settings: the noise of their samples."""

from attnzoo.configuration.base import ZooConfig
from attnzoo.validation import check_noise_std


class ZooSamplingSettings(ZooConfig):
    """The setting of the attentions that draw Gaussian samples of ω (RA, LARA).

    Args:
        sample_noise_std: σ of the training-time sampling noise: "paper" (1.0, the default), "official"
            (d**-0.25, what the authors' code does) or a number. What each family does with it, and why "paper" is
            the default: `ZooRASettings` and `ZooLARASettings`.
    """

    sample_noise_std: str | float = "paper"

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_noise_std(self)
