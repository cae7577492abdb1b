"""The documents of the attnzoo_passkey lm-eval tasks: the prompts of `attnzoo.evaluation.passkey` (the ones
`passkey_accuracy` and the benchmarks generate from: the same keys, fillers and lengths in the model's own tokens),
as text, so that `lm_eval --model hf --model_args pretrained=... --include_path <this folder's parent> --tasks
attnzoo_passkey --metadata '{"max_seq_lengths": [1024]}'` scores any causal LM, an attnzoo checkpoint or a plain
transformers one, on what `passkey_accuracy` measures.

lm-eval calls the builders with its `--metadata` and the model's arguments (`pretrained`, or `tokenizer`): the
lengths are counted in that tokenizer's tokens. Trial t of every cell uses `random.Random(f"{seed}:{t}")`, as
`passkey_accuracy` does. A prompt is the decoded text of its tokens, without the tokenizer's leading special tokens
(lm-eval's `hf` model adds those itself where the model wants them).
"""

from __future__ import annotations

import random

DEFAULT_LENGTHS = (1024,)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _tokenizer(kwargs: dict):
    from transformers import AutoTokenizer

    name = kwargs.get("tokenizer") or kwargs.get("pretrained")
    if not name:
        raise ValueError("the attnzoo_passkey tasks size their prompts in the model's tokens: pass the model "
                         "(--model_args pretrained=...) or --metadata '{\"tokenizer\": ...}'.")
    return AutoTokenizer.from_pretrained(name, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def _row(tokenizer, prompt, length: int) -> dict:
    text = tokenizer.decode(prompt.input_ids, skip_special_tokens=True)
    return {"context": text, "passkey": prompt.passkey, "length": length, "depth": prompt.depth,
            "distance": len(prompt.input_ids) - prompt.key_position}


def _task_description(kwargs: dict) -> bool:
    """`task_description` (default true): false drops the opening task description, as the training sequences of
    `--passkey_fraction` do (a model trained on those is measured on the prompts it learned)."""
    value = kwargs.get("task_description", True)
    if not isinstance(value, bool):
        raise ValueError(f"task_description={value!r} in --metadata: pass true or false.")
    return value


def _filler(kwargs: dict) -> str:
    """`filler` (default "repeat"): one of `attnzoo.evaluation.passkey.FILLERS`, as `passkey_accuracy` takes it."""
    from attnzoo.evaluation.passkey import FILLERS

    value = kwargs.get("filler", "repeat")
    if value not in FILLERS:
        raise ValueError(f"filler={value!r} in --metadata: pass one of {list(FILLERS)}.")
    return value


def passkey_documents(**kwargs):
    """Prompts of every (length, depth) cell, `trials` each: `max_seq_lengths`, `depths`, `trials`, `seed`,
    `task_description`, `filler`."""
    from attnzoo.evaluation.passkey import passkey_prompt

    tokenizer = _tokenizer(kwargs)
    trials, seed, described = int(kwargs.get("trials", 5)), kwargs.get("seed", 0), _task_description(kwargs)
    filler = _filler(kwargs)
    return _dataset([_row(tokenizer, passkey_prompt(tokenizer, int(length), float(depth),
                                                    random.Random(f"{seed}:{t}"), task_description=described,
                                                    filler=filler),
                          int(length))
                     for length in kwargs.get("max_seq_lengths", DEFAULT_LENGTHS)
                     for depth in kwargs.get("depths", DEFAULT_DEPTHS) for t in range(trials)])


def passkey_distance_documents(**kwargs):
    """Prompts whose key line starts `distances` tokens before the end of the prompt, for every length of
    `max_seq_lengths` that holds them: the depth is chosen to put the key there (to the token where the filler
    allows it); also `task_description` and `filler`."""
    from attnzoo.evaluation.passkey import minimum_length, passkey_prompt

    tokenizer = _tokenizer(kwargs)
    trials, seed, described = int(kwargs.get("trials", 5)), kwargs.get("seed", 0), _task_description(kwargs)
    shortest, filler_kind = minimum_length(tokenizer, task_description=described), _filler(kwargs)
    rows = []
    for length in map(int, kwargs.get("max_seq_lengths", DEFAULT_LENGTHS)):
        filler = length - shortest
        for distance in map(int, kwargs.get("distances", (length // 2,))):
            # tokens after the key line's start: key line + filler after + question = distance
            after = distance - (shortest - _head_length(tokenizer, described))
            if filler <= 0 or not 0 <= after <= filler:
                raise ValueError(f"distance {distance} does not fit a prompt of {length} tokens; pass distances "
                                 f"between {shortest - _head_length(tokenizer, described)} and "
                                 f"{shortest - _head_length(tokenizer, described) + max(filler, 0)}.")
            depth = 1.0 - after / filler
            rows += [_row(tokenizer, passkey_prompt(tokenizer, length, depth, random.Random(f"{seed}:{t}"),
                                                    task_description=described, filler=filler_kind), length)
                     for t in range(trials)]
    return _dataset(rows)


def _head_length(tokenizer, task_description: bool = True) -> int:
    from attnzoo.evaluation.passkey import _description, _leading_special_ids

    return len(_leading_special_ids(tokenizer)) + (len(_description(tokenizer)) if task_description else 0)


def process_results(doc: dict, results: list[str]) -> dict:
    """Landmark Attention's score, as `passkey_accuracy` scores: the first run of digits is the key."""
    from attnzoo.evaluation.passkey import is_correct

    return {"acc": float(is_correct(results[0], doc["passkey"]))}
