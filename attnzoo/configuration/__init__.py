from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.hybrid import ZooHybridConfig
from attnzoo.configuration.lara import ZooLARAConfig
from attnzoo.configuration.performer import ZooPerformerConfig
from attnzoo.configuration.ra import ZooRAConfig
from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.configuration.softmax import ZooSoftmaxConfig
from attnzoo.configuration.window import ZooWindowConfig

__all__ = ["ZooConfig", "ZooHybridConfig", "ZooLARAConfig", "ZooPerformerConfig", "ZooRAConfig", "ZooReformerConfig",
           "ZooSoftmaxConfig", "ZooWindowConfig"]
