from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.configuration.softmax import ZooSoftmaxConfig

__all__ = ["ZooConfig", "ZooPerformerConfig", "ZooSoftmaxConfig"]
