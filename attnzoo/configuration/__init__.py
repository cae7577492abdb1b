from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.lara import ZooLARAConfig
from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.configuration.ra import ZooRAConfig
from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.configuration.softmax import ZooSoftmaxConfig

__all__ = ["ZooConfig", "ZooLARAConfig", "ZooPerformerConfig", "ZooRAConfig", "ZooReformerConfig", "ZooSoftmaxConfig"]
