"""A byte-level tokenizer whose token id is the byte value (0-255), as byte-level LMs on enwik8 use, followed by
five special tokens: <pad> 256, <s> 257 (bos), </s> 258 (eos), <unk> 259 and <mask> 260.

It is a regular `PreTrainedTokenizerFast` (no custom code), so it saves beside a checkpoint and loads with
`AutoTokenizer` wherever transformers is installed. Built on `tokenizers`' ByteLevel pre-tokenizer with a 256-symbol
BPE vocabulary and no merges; the special tokens make collators (causal and masked), batched pipelines, fill-mask and
`generate()`'s end-of-text stop work. As with every Hugging Face tokenizer, the special tokens' strings ("</s>", ...)
in input text encode to their ids; the training scripts read byte corpora as raw bytes, so data is never affected.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

NUM_BYTES = 256
#: the special tokens, in id order after the 256 bytes
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                  "mask_token": "<mask>"}
BYTE_LEVEL_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)


def byte_level_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer; `model_max_length` should be the model's max_position_embeddings (the training
    scripts set it), so `truncation=True` cuts inputs to what the model can take. Padding is on the right, as
    training collators want (no label is then predicted from a padded position); the text-generation pipeline
    switches to left padding itself, and batched `generate()` calls should pass `padding_side="left"`."""
    byte_symbol = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_symbol[b]: b for b in range(NUM_BYTES)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in SPECIAL_TOKENS.values()])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False, **SPECIAL_TOKENS)


def is_byte_level(tokenizer) -> bool:
    """Whether `tokenizer` maps every byte to its own value (this module's tokenizer, or the 256-token one that
    checkpoints written before the special tokens carry), so raw bytes can be fed as ids without tokenising."""
    if len(tokenizer) < NUM_BYTES:
        return False
    byte_symbol = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_symbol[b] for b in range(NUM_BYTES)]) == list(range(NUM_BYTES))
