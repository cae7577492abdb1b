"""The softmax baseline family: the shared backbone with exact (SDPA) attention in every layer."""

from attnzoo.configuration.base import ZooConfig


class ZooSoftmaxConfig(ZooConfig):
    """Exact softmax attention everywhere; the baseline every efficient family is compared against."""

    model_type = "attnzoo_softmax"

    attn_layers: list[str] | tuple[str, ...] = ("full",)
