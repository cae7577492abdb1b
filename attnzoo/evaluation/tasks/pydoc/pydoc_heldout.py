"""The documents of the attnzoo_pydoc_* lm-eval tasks: prose from the held-out tail of the text the quick start trains
on (CPython's pydoc help topics, `attnzoo.corpus.default_corpus_text`; scripts/train_lm.py holds out its
last 5%), so a quick-start model is never scored on text it trained on.

lm-eval loads this file by its path (`!function` in the YAML files beside it), wherever the folder is passed as
`--include_path`; it imports only the standard library, so the tasks also run where attnzoo is not installed. The
corpus comes with the running Python, so the tasks follow the training text of the same Python version.
"""

from __future__ import annotations

import random
import re

#: scripts/train_lm.py's --heldout_fraction default: the final fraction of the corpus's UTF-8 bytes it never trains on
HELDOUT_FRACTION = 0.05
#: a document or sentence needs at least this many words
MIN_WORDS = 8
#: wrong endings offered beside the true one in attnzoo_pydoc_endings
NUM_DISTRACTORS = 3
#: an ending is at most this many UTF-8 bytes, so that models with short contexts (lm-eval refuses a continuation
#: longer than the model's context; a byte-level model has one token per byte) can take the task too
MAX_ENDING_BYTES = 96
_SENTENCE_END = re.compile(r"(?<=[.:;])\s+(?=[A-Z])")


def corpus_text() -> str:
    """The quick start's corpus, built as `attnzoo.corpus.default_corpus_text` builds it."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"


def heldout_text() -> str:
    """The held-out bytes of the corpus (split as `attnzoo.training.text_data.split_bytes` splits it), as text; a
    character cut in two at the start is dropped."""
    data = corpus_text().encode("utf-8")
    return data[int(len(data) * (1.0 - HELDOUT_FRACTION)):].decode("utf-8", errors="ignore")


def _is_prose(paragraph: str) -> bool:
    # Tables, code, lists and grammar rules are indented or start with a marker; prose is mostly letters.
    lines = paragraph.split("\n")
    if any(line.startswith((" ", "|", "+", "-", "=", ">", "*")) for line in lines):
        return False
    letters = sum(c.isalpha() or c in " ,." for c in paragraph)
    return len(paragraph.split()) >= MIN_WORDS and letters / len(paragraph) > 0.88


def paragraphs() -> list[str]:
    """The held-out prose paragraphs, each on one line and once (the topics repeat some notes). The first block is
    left out: the split cuts it anywhere."""
    blocks = heldout_text().split("\n\n")[1:]
    return list(dict.fromkeys(" ".join(block.split()) for block in blocks if _is_prose(block.strip())))


def sentences() -> list[str]:
    """The sentences of the paragraphs, each once."""
    return list(dict.fromkeys(s for p in paragraphs() for s in _SENTENCE_END.split(p) if len(s.split()) >= MIN_WORDS))


def _as_dataset(rows: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(rows)})


def perplexity_documents(**_metadata):
    """attnzoo_pydoc_perplexity: one held-out paragraph per document, scored whole (rolling windows)."""
    return _as_dataset([{"text": p} for p in paragraphs()])


def ending_documents(**_metadata):
    """attnzoo_pydoc_endings: the start of a sentence and four different endings, the true one among the endings of
    other sentences (drawn and placed with a seed per sentence, so the task never changes). An ending is the second
    half of the sentence's words, or fewer of its last words where that half is longer than MAX_ENDING_BYTES."""
    halves = []
    for sentence in sentences():
        words = sentence.split()
        cut = len(words) // 2
        while len(" ".join(words[cut:]).encode("utf-8")) > MAX_ENDING_BYTES:
            cut += 1
        if cut == len(words):  # a single "word" longer than an ending may be (a URL, say)
            continue
        halves.append((" ".join(words[:cut]), " ".join(words[cut:])))
    all_endings = sorted({ending for _, ending in halves})
    rows = []
    for i, (context, ending) in enumerate(halves):
        rng = random.Random(i)
        others = rng.sample([e for e in all_endings if e != ending], NUM_DISTRACTORS)
        label = rng.randrange(NUM_DISTRACTORS + 1)
        rows.append({"context": context, "endings": others[:label] + [ending] + others[label:], "label": label})
    return _as_dataset(rows)


def next_word_documents(**_metadata):
    """attnzoo_pydoc_next_word: a sentence cut before its last word of three or more letters (at least five words
    in), and that word."""
    rows = []
    for sentence in sentences():
        words = sentence.split()
        for k in range(len(words) - 1, 4, -1):
            word = words[k].strip("\"'().,:;*")
            if word.isalpha() and word.isascii() and len(word) >= 3:
                rows.append({"context": " ".join(words[:k]), "word": word})
                break
    return _as_dataset(rows)
