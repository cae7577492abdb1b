from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.block_retrieval import ZooBlockRetrievalSettings
from attnzoo.configuration.hybrid import ZooHybridConfig
from attnzoo.configuration.lara import ZooLARAConfig, ZooLARASettings
from attnzoo.configuration.performer import ZooPerformerConfig, ZooPerformerSettings
from attnzoo.configuration.ra import ZooRAConfig, ZooRASettings
from attnzoo.configuration.reformer import ZooReformerConfig, ZooReformerSettings
from attnzoo.configuration.sampling import ZooSamplingSettings
from attnzoo.configuration.softmax import ZooSoftmaxConfig
from attnzoo.configuration.window import ZooWindowConfig, ZooWindowSettings

# The family configs; the settings classes are the groups of fields the families' attentions read, which the
# family configs (and the hybrid one) are built from.
__all__ = ["ZooBlockRetrievalSettings", "ZooConfig", "ZooHybridConfig", "ZooLARAConfig", "ZooLARASettings",
           "ZooPerformerConfig", "ZooPerformerSettings", "ZooRAConfig", "ZooRASettings", "ZooReformerConfig",
           "ZooReformerSettings", "ZooSamplingSettings", "ZooSoftmaxConfig", "ZooWindowConfig", "ZooWindowSettings"]
