"""The default corpus: English text every CPython ships, so the quick start, the passkey filler and the local
lm-eval tasks need no download. Training data (`training.text_data`) and evaluation (`evaluation.passkey`) both read
it from here."""

from __future__ import annotations


def default_corpus_text() -> str:
    """CPython's pydoc help topics (the language reference's prose, ~460 KB), as plain text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"
