"""Passkey retrieval: a number hidden in filler text that the model must repeat when asked, as in "Landmark Attention:
Random-Access Infinite Context Length for Transformers" (arXiv 2305.16300) and "Extending Context Window of Large
Language Models via Positional Interpolation" (arXiv 2306.15595). It is the quickest check of long-context recall,
which linearised attentions are known to lose ("LoLA: Low-Rank Linear Attention With Sparse Caching",
arXiv 2505.23666).

A prompt is, in the papers' words and layout (pieces joined by newlines):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you
    about the important information there.           (the task description; `task_description=False` drops it)
    <filler before>
    The pass key is 12345. Remember it. 12345 is the pass key.
    <filler after>
    What is the pass key? The pass key is

and the expected continuation is " 12345". Everything is measured in the model's tokens: each piece is tokenised on
its own and the filler is cut to the exact number of tokens left, so a prompt has exactly the requested length (cut
filler may end mid-word, as Landmark Attention's character cut does). The depth is the fraction of the filler before
the key line: 0 puts the key line right after the task description, 1 right before the question.

Three functions:
- `passkey_prompt`: one prompt (deterministic in its seed);
- `passkey_accuracy`: greedy generation on a grid of lengths x depths, batched with left padding, for any causal LM;
- `passkey_training_blocks`: fixed-length training sequences that end with the answer, for mixing retrieval into
  language-model data (pure: tokens in, tokens out).
"""

from __future__ import annotations

import functools
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: Landmark Attention's filler sentence (repeated)
DEFAULT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TASK_DESCRIPTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                    "I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"
#: what ends the answer of a training sequence: the key line's own punctuation, so that a trained model stops after
#: the key (Landmark's score reads the first run of digits; a model trained on sequences ending at the key's last
#: digit goes on with more digits: one retrieved 65019 and wrote 6501991)
TRAINING_ANSWER_END = "."
#: "repeat": filler_text over and over from its start; "repeat_shifted": the same, from a token of filler_text drawn
#: for each prompt, so that prompts of one length and depth differ in where the filler is cut around the key line and
#: the question, not only in the key (a model can depend on that cut: one retrieved at most prompt lengths and failed
#: at a few in between, as the cut moved); "corpus": prose sentences of the default corpus drawn for each prompt
FILLERS = ("repeat", "repeat_shifted", "corpus")
#: how the generated continuation is scored (Landmark Attention's rule)
SCORING = "correct when the first run of digits in the greedy continuation equals the pass key"
#: tokens generated beyond the answer's own length: room for a tokenizer that splits the digits differently
EXTRA_NEW_TOKENS = 2
#: transformers model types with a learned absolute position table, and the config field that bounds it: beyond it
#: they index past the table (an IndexError on the CPU, a device-side assert on a GPU) instead of raising ValueError
LEARNED_POSITION_TABLES = {"gpt2": "n_positions", "gpt_bigcode": "n_positions", "gpt_neo": "max_position_embeddings",
                           "opt": "max_position_embeddings", "biogpt": "max_position_embeddings"}


@dataclass(frozen=True)
class PasskeyPrompt:
    """One prompt. `key_position` is the index of the key line's first token in `input_ids` and `key_end` one past
    its last; `depth` is the fraction of the filler tokens placed before it (the requested depth rounded to a whole
    token; the requested one when there is no filler)."""

    input_ids: list[int]
    answer_ids: list[int]
    passkey: str
    key_position: int
    key_end: int
    depth: float
    filler_tokens: int


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _leading_special_ids(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before any text by default (a Llama tokenizer's <s>; nothing for the byte-level
    and GPT-2 ones), so a prompt starts as the model saw text start in training."""
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    plain = _encode(tokenizer, "a")
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start]
    return []


def _answer_ids(tokenizer, key: str, ending: str = "") -> list[int]:
    """The answer's tokens (followed by `ending`) as they follow the question: encoded together and split, when the
    question's own tokens are a prefix of the joint encoding (BPE may merge across the boundary otherwise)."""
    answer = ANSWER.format(key=key) + ending
    question, joint = _encode(tokenizer, QUESTION), _encode(tokenizer, QUESTION + answer)
    if joint[:len(question)] == question and len(joint) > len(question):
        return joint[len(question):]
    return _encode(tokenizer, answer)


@functools.lru_cache(maxsize=1)
def corpus_sentences() -> tuple[str, ...]:
    """Prose sentences of attnzoo's default corpus (CPython's pydoc topics) without digits (the key must be the only
    number in the prompt) and without code or headings: 30 to 300 characters of letters and punctuation,
    capitalised, no "--" (the topics underline their headings with dashes)."""
    from attnzoo.corpus import default_corpus_text

    text = re.sub(r"\s+", " ", default_corpus_text())
    sentence = re.compile(r"[A-Z][A-Za-z ,;:'()\-]{28,298}[.!?]")
    return tuple(s for s in re.split(r"(?<=[.!?]) ", text) if sentence.fullmatch(s) and "--" not in s)


def _filler_ids(tokenizer, count: int, filler: str, filler_text: str, rng: random.Random) -> list[int]:
    if count <= 0:
        return []
    if filler in ("repeat", "repeat_shifted"):
        unit = _encode(tokenizer, filler_text + " ")
        if not unit:
            raise ValueError("filler_text encodes to no tokens; pass some text to repeat.")
        start = rng.randrange(len(unit)) if filler == "repeat_shifted" else 0
        return (unit * (count // len(unit) + 2))[start:start + count]
    sentences, ids = corpus_sentences(), []
    while len(ids) < count:  # one sentence at a time: a long text would trip the tokenizer's max-length warning
        ids += _encode(tokenizer, rng.choice(sentences) + " ")
    return ids[:count]


def _rng(seed: int | random.Random) -> random.Random:
    return seed if isinstance(seed, random.Random) else random.Random(seed)


def _check_depth(depth: float, name: str = "depth") -> float:
    try:
        value = float(depth)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 <= value <= 1:  # NaN fails too
        raise ValueError(f"{name}={depth!r} is outside [0, 1]; pass the fraction of the filler that comes before the "
                         "key line: 0 (right after the start) to 1 (right before the question).")
    return value


def _check_filler(filler: str) -> None:
    if filler not in FILLERS:
        raise ValueError(f"filler={filler!r}; pass one of {FILLERS} ('repeat' repeats filler_text, 'repeat_shifted' "
                         "repeats it from a random token, 'corpus' draws sentences of the default corpus).")


def _description(tokenizer) -> list[int]:
    return _encode(tokenizer, TASK_DESCRIPTION + "\n")


def _pieces(tokenizer, key: str, task_description: bool) -> tuple[list[int], list[int], list[int]]:
    """The fixed parts of a prompt: start (special tokens, task description), key line, question."""
    head = _leading_special_ids(tokenizer) + (_description(tokenizer) if task_description else [])
    return head, _encode(tokenizer, "\n" + NEEDLE.format(key=key) + "\n"), _encode(tokenizer, "\n" + QUESTION)


def passkey_prompt(tokenizer, length: int, depth: float, seed: int | random.Random = 0, *, digits: int = 5,
                   passkey: str | None = None, filler: str = "repeat", filler_text: str = DEFAULT_FILLER,
                   task_description: bool = True) -> PasskeyPrompt:
    """A prompt of exactly `length` tokens of `tokenizer` with the key line at `depth` (see the module docstring).
    The key is `passkey` or `digits` random digits (first one not 0) drawn from `seed` (an int, or a
    `random.Random` to draw from); `filler="corpus"` draws the filler from the default corpus with the same seed, and
    `filler="repeat_shifted"` where in filler_text the repeated filler starts.
    Raises ValueError when `length` cannot hold the fixed pieces, naming the minimum."""
    depth = _check_depth(depth)
    _check_filler(filler)
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits={digits!r}; pass the number of digits of the pass key, at least 1.")
    rng = _rng(seed)
    key = passkey if passkey is not None else str(rng.randrange(10 ** (digits - 1), 10 ** digits))
    if not key.isdigit():
        raise ValueError(f"passkey={passkey!r}; pass a string of digits (the score compares digits).")
    head, needle, question = _pieces(tokenizer, key, task_description)
    minimum = len(head) + len(needle) + len(question)
    if not isinstance(length, int) or length < minimum:
        saving = f"; task_description=False saves {len(_description(tokenizer))} tokens" if task_description else ""
        raise ValueError(f"length={length!r} is too short to hold the pass key line and the question: the minimum is "
                         f"{minimum} tokens of this tokenizer with a {len(key)}-digit key{saving}; pass a longer "
                         "length.")
    filler_count = length - minimum
    before = round(depth * filler_count)
    filler_ids = _filler_ids(tokenizer, filler_count, filler, filler_text, rng)
    input_ids = head + filler_ids[:before] + needle + filler_ids[before:] + question
    return PasskeyPrompt(input_ids=input_ids, answer_ids=_answer_ids(tokenizer, key), passkey=key,
                         key_position=len(head) + before, key_end=len(head) + before + len(needle),
                         depth=before / filler_count if filler_count else depth, filler_tokens=filler_count)


def minimum_length(tokenizer, *, digits: int = 5, task_description: bool = True) -> int:
    """The shortest prompt (in tokens) that holds the fixed pieces with a `digits`-digit key (a key of 9s: keys of
    other digits may tokenise to a different count under BPE; the byte-level tokenizer gives every key the same)."""
    return sum(map(len, _pieces(tokenizer, "9" * digits, task_description)))


def is_correct(continuation: str, passkey: str) -> bool:
    """Landmark Attention's score: the first run of digits the model writes is the key (" 12345." and " 12345" count;
    " 1234", " 123456" and a continuation without digits do not)."""
    found = re.search(r"\d+", continuation)
    return found is not None and found.group() == passkey


# -- evaluation -----------------------------------------------------------------------------------------------------
def position_limit(model) -> tuple[str, int] | None:
    """(config field, number of positions) when the model has a position table it cannot go beyond: attnzoo's
    learned and axial positions (they raise ValueError past `max_position_embeddings`) and transformers' learned
    absolute tables (LEARNED_POSITION_TABLES); None for rotary, sinusoidal, ALiBi and position-free models, which
    run at any length (how well is what the benchmark measures)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    kind = getattr(config, "position_embedding_type", None)
    if kind in ("learned", "axial") and getattr(config, "max_position_embeddings", None):
        return "max_position_embeddings", int(config.max_position_embeddings)
    field = LEARNED_POSITION_TABLES.get(getattr(config, "model_type", None))
    if field and getattr(config, field, None):
        return field, int(getattr(config, field))
    return None


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def _position_refusal(error: BaseException) -> str | None:
    """The not-run reason when `error` is a model refusing a sequence longer than its position table (attnzoo's
    learned/axial positions: "... but max_position_embeddings=N; ..."), else None (any other error propagates)."""
    found = re.search(r"max_position_embeddings=(\d+)", str(error))
    if isinstance(error, ValueError) and found:
        return f"not run (beyond max_position_embeddings={found.group(1)})"
    return None


def _free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pad_left(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding, as batched generation needs (every row's last token is its own last token)."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def _pad_id(tokenizer) -> int:
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0  # masked out; any id will do


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    parameter = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return parameter.device if parameter is not None else torch.device("cpu")


def _generate(model, tokenizer, prompts: list[PasskeyPrompt], max_new_tokens: int) -> list[str]:
    pad_id = _pad_id(tokenizer)
    ids, mask = _pad_left([p.input_ids for p in prompts], pad_id, _model_device(model))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id)
    return tokenizer.batch_decode(out[:, ids.shape[1]:].tolist(), skip_special_tokens=True)


def _warm_up(model, tokenizer, prompt: PasskeyPrompt, limit: tuple[str, int] | None) -> None:
    """One untimed generate() of one short prompt, so one-off costs (kernel selection, lazy imports, compilation)
    do not count against the first length's time budget. Out of memory or a position refusal here is left for the
    timed run to meet and record."""
    if limit is not None and len(prompt.input_ids) + 1 > limit[1]:
        return
    try:
        _generate(model, tokenizer, [prompt], 2)
    except Exception as error:  # noqa: BLE001 - anything but these two propagates
        if not (_is_out_of_memory(error) or _position_refusal(error)):
            raise
    _free_memory()


def _depth_key(depth: float) -> str:
    return f"{depth:g}"


def passkey_accuracy(model, tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int = 5,
                     seed: int = 0, batch_size: int = 8, *, max_seconds_per_length: float | None = None,
                     digits: int = 5, filler: str = "repeat", filler_text: str = DEFAULT_FILLER,
                     task_description: bool = True, extra_new_tokens: int = EXTRA_NEW_TOKENS,
                     samples: int = 2, log: Callable[[str], None] | None = None) -> dict:
    """Pass-key accuracy of a causal LM on every (length, depth) cell, `trials` prompts each, by greedy
    `model.generate` (`max_new_tokens` = the answer's length + `extra_new_tokens`) scored by `is_correct`.

    Prompts are batched `batch_size` at a time across the depths of one length, left-padded (the tokenizer's pad
    token, else its eos). Trial t of every cell uses the same key (and corpus filler or filler shift), drawn from
    `random.Random(f"{seed}:{t}")`, so cells differ only in length and depth.

    How far it goes (lengths run shortest first):
    - a model with a position table (`position_limit`) is not run where the prompt plus the generated tokens need
      more positions than it has: the cell reads "not run (beyond max_position_embeddings=N)" (or n_positions), as
      it does when an attnzoo model raises that ValueError itself; rotary and position-free models run at any length;
    - out of memory (torch.OutOfMemoryError, or a RuntimeError saying out of memory / can't allocate memory): the
      batch is halved and retried; at batch size 1 this length and every longer one are not run;
    - `max_seconds_per_length`: once a length has taken longer, longer lengths are not run (checked after every
      batch: the cells of this length still unfinished are not run either, finished ones keep their score). One
      untimed generate() of a short prompt runs first, so one-off start-up costs do not count.

    The model is put in eval mode for the run and restored. Returns a JSON-ready dict: "accuracy" (length -> depth
    -> accuracy in [0, 1], None where not run), "cells" (one row per cell: correct, trials, status, the mean depth
    and key position actually used, the first `samples` continuations), "lengths" (seconds, batch size, status per
    length), "stopped" (why longer lengths were not run, or None) and "setup"."""
    lengths = sorted({int(n) for n in lengths})
    depths = list(dict.fromkeys(_check_depth(d, "depths") for d in depths))  # a repeated depth is one cell
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths={lengths}; pass one or more positive prompt lengths in tokens (e.g. 1024 2048).")
    if not depths:
        raise ValueError("depths is empty; pass one or more depths in [0, 1] (e.g. 0 0.25 0.5 0.75 1).")
    for name, value in (("trials", trials), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; pass a positive integer.")
    if max_seconds_per_length is not None and max_seconds_per_length < 0:
        raise ValueError(f"max_seconds_per_length={max_seconds_per_length}; pass seconds >= 0, or None for no limit.")
    options = dict(digits=digits, filler=filler, filler_text=filler_text, task_description=task_description)

    def prompts_of(length: int) -> list[tuple[float, PasskeyPrompt]]:
        return [(depth, passkey_prompt(tokenizer, length, depth, random.Random(f"{seed}:{t}"), **options))
                for depth in depths for t in range(trials)]

    first = prompts_of(lengths[0])  # bad settings (a length too short, ...) fail here, before any model time is spent
    limit = position_limit(model)
    cells = {(n, d): {"length": n, "depth": d, "accuracy": None, "correct": 0, "done": 0, "trials": trials,
                      "status": None, "depth_used": [], "key_position": [], "samples": []}
             for n in lengths for d in depths}
    per_length, stopped, size = {}, None, batch_size  # a batch size halved for memory stays halved for longer lengths

    def not_run(length: int, reason: str, **extra) -> None:
        per_length[length] = {"seconds": None, "batch_size": None, "status": reason, **extra}
        for depth in depths:
            cells[length, depth]["status"] = reason
        if log is not None:
            log(f"length {length}: {reason}")

    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        _warm_up(model, tokenizer, first[0][1], limit)
        for length in lengths:
            if stopped is not None:
                not_run(length, stopped)
                continue
            prompts = prompts_of(length)
            max_new = max(len(p.answer_ids) for _, p in prompts) + extra_new_tokens
            needed = max(len(p.input_ids) for _, p in prompts) + max_new - 1  # the last new token is not fed back
            if limit is not None and needed > limit[1]:
                not_run(length, f"not run (beyond {limit[0]}={limit[1]})", positions_needed=needed)
                continue
            started, done, problem = time.perf_counter(), 0, None
            while done < len(prompts) and problem is None:
                chunk = prompts[done:done + size]
                out_of_memory = False
                try:
                    continuations = _generate(model, tokenizer, [p for _, p in chunk], max_new)
                except Exception as error:  # noqa: BLE001 - only memory and position refusals are handled
                    if _is_out_of_memory(error):
                        out_of_memory = True
                    elif (problem := _position_refusal(error)) is None:
                        raise
                if out_of_memory:  # handled outside the except block, so the error's frames (and tensors) are freed
                    _free_memory()
                    if size > 1:
                        size //= 2
                        continue
                    problem = f"not run (out of memory at length {length} with batch size 1)"
                    break
                if problem is not None:
                    break
                for (depth, prompt), text in zip(chunk, continuations, strict=True):
                    cell = cells[length, depth]
                    cell["correct"] += is_correct(text, prompt.passkey)
                    cell["done"] += 1
                    cell["depth_used"].append(prompt.depth)
                    cell["key_position"].append(prompt.key_position)
                    if len(cell["samples"]) < samples:
                        cell["samples"].append(text)
                done += len(chunk)
                elapsed = time.perf_counter() - started
                if max_seconds_per_length is not None and elapsed > max_seconds_per_length:
                    stopped = (f"not run (length {length} took {elapsed:.1f} s > max_seconds_per_length="
                               f"{max_seconds_per_length:g})")
                    if done < len(prompts):
                        problem = stopped
            seconds = time.perf_counter() - started
            if problem is not None:
                stopped = problem
            for depth in depths:
                cell = cells[length, depth]
                cell["status"] = "run" if cell["done"] == trials else stopped
            status = "run" if problem is None else ("partly run: " + problem if done else problem)
            per_length[length] = {"seconds": round(seconds, 3), "batch_size": size, "status": status}
            if log is not None:
                row = ", ".join(f"{_depth_key(d)}: " + ("n/a" if cells[length, d]["status"] != "run" else
                                                      f"{cells[length, d]['correct'] / trials:.2f}") for d in depths)
                log(f"length {length}: {row} ({seconds:.1f} s){'' if stopped is None else '; then ' + stopped}")
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    rows = []
    for cell in cells.values():
        run = cell["status"] == "run"
        rows.append({"length": cell["length"], "depth": cell["depth"],
                     "accuracy": cell["correct"] / trials if run else None,
                     "correct": cell["correct"] if run else None, "trials": trials, "status": cell["status"],
                     "depth_used": sum(cell["depth_used"]) / trials if run else None,
                     "key_position": (sum(cell["key_position"]) / trials if run else None),
                     "samples": cell["samples"] if run else []})
    return {
        "accuracy": {str(n): {_depth_key(d): cells[n, d]["correct"] / trials if cells[n, d]["status"] == "run"
                              else None for d in depths} for n in lengths},
        "cells": rows,
        "lengths": {str(n): per_length[n] for n in lengths},
        "stopped": stopped,
        "setup": {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "batch_size": batch_size,
                  "max_seconds_per_length": max_seconds_per_length, "digits": digits, "filler": filler,
                  "filler_text": filler_text if filler == "repeat" else None, "task_description": task_description,
                  "extra_new_tokens": extra_new_tokens, "scoring": SCORING,
                  "position_limit": None if limit is None else {limit[0]: limit[1]}},
    }


# -- training data --------------------------------------------------------------------------------------------------
def passkey_training_blocks(tokenizer, block_size: int, count: int, seed: int = 0, *, digits: int = 5,
                            filler: str = "repeat", filler_text: str = DEFAULT_FILLER, task_description: bool = True,
                            depths: Sequence[float] | None = None, with_answer_mask: bool = False,
                            min_distance: int = 0):
    """`count` passkey sequences of exactly `block_size` tokens, each a prompt followed by its answer (" 12345.",
    the key and `TRAINING_ANSWER_END`), so the answer tokens are the block's last ones and next-token training on
    the block teaches retrieval. To mix retrieval into a language-model data set at a fraction f, add f / (1 - f)
    blocks of these per text block.

    Block i draws its depth (uniform in [0, 1], or from `depths`), key and corpus filler from
    `random.Random(seed)`; the same arguments give the same blocks. With `min_distance`, depths are drawn so that the
    key line starts more than that many tokens before the answer (see `passkey_training_block`). Returns a
    LongTensor [count, block_size], and with `with_answer_mask` also a bool tensor of the same shape that is True on
    the answer tokens (to weight or restrict the loss)."""
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r}; pass the number of blocks, an integer >= 0.")
    rng = random.Random(seed)
    blocks = torch.empty((count, block_size if isinstance(block_size, int) else 0), dtype=torch.long)
    answer_mask = torch.zeros(blocks.shape, dtype=torch.bool)
    for i in range(count):
        blocks[i], answer_mask[i] = passkey_training_block(
            tokenizer, block_size, rng, digits=digits, filler=filler, filler_text=filler_text,
            task_description=task_description, depths=depths, min_distance=min_distance)
    if count == 0:  # the arguments are still checked
        passkey_training_block(tokenizer, block_size, random.Random(seed), digits=digits, filler=filler,
                               filler_text=filler_text, task_description=task_description, depths=depths,
                               min_distance=min_distance)
    return (blocks, answer_mask) if with_answer_mask else blocks


def passkey_training_block(tokenizer, block_size: int, rng: random.Random, *, digits: int = 5,
                           filler: str = "repeat", filler_text: str = DEFAULT_FILLER, task_description: bool = True,
                           depths: Sequence[float] | None = None, min_distance: int = 0):
    """One training sequence of `block_size` tokens (prompt + answer) drawn from `rng` -> (LongTensor [block_size],
    bool answer mask [block_size]).

    `min_distance`: the key line starts more than this many tokens before the first answer token, so that a model
    whose exact window holds `min_distance` tokens must fetch the key through its far part. The depth is drawn
    uniformly over the depths that allow it, which spreads the distances evenly over (min_distance, the longest the
    block allows]."""
    if depths is not None:
        depths = [_check_depth(d, "depths") for d in depths]
        if not depths:
            raise ValueError("depths is empty; pass depths in [0, 1], or None for uniform random depths.")
        if min_distance:
            raise ValueError("depths and min_distance both place the key; pass one of them.")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}; pass the block length in tokens, a positive integer.")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits={digits!r}; pass the number of digits of the pass key, at least 1.")
    if not isinstance(min_distance, int) or min_distance < 0:
        raise ValueError(f"min_distance={min_distance!r}; pass a number of tokens >= 0 (0: any distance).")
    _check_filler(filler)
    key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
    answer = _answer_ids(tokenizer, key, TRAINING_ANSWER_END)
    length = block_size - len(answer)
    head, needle, question = _pieces(tokenizer, key, task_description)
    filler_count = length - len(head) - len(needle) - len(question)
    if filler_count < 0:
        need = len(head) + len(needle) + len(question) + len(answer)
        raise ValueError(f"block_size={block_size} cannot hold a pass key prompt and its answer: the minimum is "
                         f"{need} tokens of this tokenizer (task_description=False makes it shorter); pass a larger "
                         "block_size.")
    if depths is not None:
        depth = rng.choice(depths)
    else:
        # the key line starts at len(head) + before; the answer at `length`: before < length - min_distance - head
        latest = min(filler_count, length - min_distance - len(head) - 1)
        if latest < 0:
            raise ValueError(f"min_distance={min_distance} leaves no room for the key in a block of {block_size} "
                             f"tokens: the farthest the key line can start from the answer is "
                             f"{length - len(head)} tokens; pass a smaller min_distance or a larger block_size.")
        depth = rng.randint(0, latest) / filler_count if filler_count else 0.0
    prompt = passkey_prompt(tokenizer, length, depth, random.Random(rng.getrandbits(64)), digits=digits,
                            passkey=key, filler=filler, filler_text=filler_text, task_description=task_description)
    ids = torch.tensor(prompt.input_ids + answer, dtype=torch.long)
    mask = torch.zeros(block_size, dtype=torch.bool)
    mask[block_size - len(answer):] = True
    return ids, mask
