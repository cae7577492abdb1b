"""A byte-level tokenizer whose token id is the byte value (0-255), as byte-level LMs on enwik8 use.

It is a regular `PreTrainedTokenizerFast`, so it saves beside a checkpoint and loads with `AutoTokenizer`. Built on
`tokenizers`' ByteLevel pre-tokenizer with a 256-symbol BPE vocabulary and no merges.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode


def byte_level_tokenizer(model_max_length: int = 1 << 30) -> PreTrainedTokenizerFast:
    byte_symbol = bytes_to_unicode()
    vocab = {byte_symbol[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)
