from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.softmax import ZooSoftmaxConfig

__all__ = ["ZooConfig", "ZooSoftmaxConfig"]
