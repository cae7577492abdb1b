from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.configuration.softmax import ZooSoftmaxConfig

__all__ = ["ZooConfig", "ZooReformerConfig", "ZooSoftmaxConfig"]
