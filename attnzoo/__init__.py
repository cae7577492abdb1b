"""attnzoo: efficient-attention Transformers as Hugging Face models: Reformer (LSH and local attention), Performer
(FAVOR+, elu+1), RA and LARA (randomized and linear randomized attention), a softmax baseline, a sliding window with
attention sinks, hybrids of them per layer, and windowed layers (an exact window beside each family's attention).
Importing the package registers every family with transformers' Auto classes."""

from attnzoo.configuration import (
    ZooConfig,
    ZooHybridConfig,
    ZooLARAConfig,
    ZooPerformerConfig,
    ZooRAConfig,
    ZooReformerConfig,
    ZooSoftmaxConfig,
    ZooWindowConfig,
)
from attnzoo.modeling import (
    ATTENTION_REGISTRY,
    ZooAttention,
    ZooCache,
    modeling_hybrid,
    modeling_lara,
    modeling_performer,
    modeling_ra,
    modeling_reformer,
    modeling_softmax,
    modeling_window,
    register_attention,
)
from attnzoo.modeling.modeling_hybrid import *  # noqa: F403  (each family module lists its classes)
from attnzoo.modeling.modeling_lara import *  # noqa: F403
from attnzoo.modeling.modeling_performer import *  # noqa: F403
from attnzoo.modeling.modeling_ra import *  # noqa: F403
from attnzoo.modeling.modeling_reformer import *  # noqa: F403
from attnzoo.modeling.modeling_softmax import *  # noqa: F403
from attnzoo.modeling.modeling_window import *  # noqa: F403
from attnzoo.registration import register_family

__version__ = "0.1.0"

# The one list of families: the scripts' and converters' `--family` choices derive from it (registration.py).
for _config_class, _module in ((ZooSoftmaxConfig, modeling_softmax), (ZooReformerConfig, modeling_reformer),
                               (ZooPerformerConfig, modeling_performer), (ZooRAConfig, modeling_ra),
                               (ZooLARAConfig, modeling_lara), (ZooHybridConfig, modeling_hybrid),
                               (ZooWindowConfig, modeling_window)):
    register_family(_config_class, _module)

__all__ = [
    "ATTENTION_REGISTRY",
    "ZooAttention",
    "ZooCache",
    "ZooConfig",
    "ZooHybridConfig",
    "ZooLARAConfig",
    "ZooPerformerConfig",
    "ZooRAConfig",
    "ZooReformerConfig",
    "ZooSoftmaxConfig",
    "ZooWindowConfig",
    "register_attention",
    *modeling_softmax.__all__,
    *modeling_reformer.__all__,
    *modeling_performer.__all__,
    *modeling_ra.__all__,
    *modeling_lara.__all__,
    *modeling_hybrid.__all__,
    *modeling_window.__all__,
]
