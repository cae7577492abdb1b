"""Token streams for language modelling: raw bytes (id == byte) from a text file or enwik8, or any text dataset
tokenised and concatenated; cut into fixed-length blocks (optionally overlapping for training, as t2t's enwik8-64K).
"""

from __future__ import annotations

import math
import random
import zipfile
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset, Dataset

from attnzoo.corpus import default_corpus_text
from attnzoo.training.data_checks import checked_json_files, missing_file_reason, read_utf8_text, utf8_text_files

PASSKEY_FRACTION_HELP = ("this fraction of the training sequences are passkey retrieval sequences (a key hidden in "
                         "filler text, then asked for; attnzoo.evaluation.passkey), generated from --seed: data "
                         "that contains the retrieval skill (0: text only); each epoch draws new ones")
PASSKEY_MIN_DISTANCE_HELP = ("passkey sequences put the key more than this many tokens before the answer "
                             "(0: anywhere), spread evenly beyond it: set the exact window's width so that retrieval "
                             "must go through the far part")

ENWIK8_HELDOUT_BYTES = 5_000_000  # valid and test are the last 2 x 5M bytes: the 90M/5M/5M split (awd-lstm, t2t)


def _as_byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def read_bytes(path: str | Path | None, skip_bad: bool = False) -> torch.Tensor:
    """The UTF-8 bytes of a text file (or of the default corpus): a byte-level LM reads the bytes, but a file that is
    not UTF-8 text (a binary file given by mistake, say) stops the run as it does for tokenised text, naming the
    line (with `skip_bad`, such lines are dropped and counted)."""
    if path is None:
        return _as_byte_tensor(default_corpus_text().encode("utf-8"))
    path = Path(path)
    if not path.is_file():
        state = missing_file_reason(path)
        raise ValueError(f"--train_file {path} {state}; pass a text file (or omit it for the default corpus).")
    data = _as_byte_tensor(read_utf8_text(path, skip_bad).encode("utf-8"))
    if data.numel() < 1024:
        raise ValueError(f"{path} holds {data.numel()} bytes; a byte-level LM needs at least 1 KB of text.")
    return data


def split_bytes(data: torch.Tensor, heldout_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - fraction) of the tokens train, the rest is held out (contiguous, as for enwik8)."""
    if not 0.0 < heldout_fraction < 0.5:
        raise ValueError(f"--heldout_fraction={heldout_fraction} must be in (0, 0.5).")
    cut = int(data.numel() * (1.0 - heldout_fraction))
    return data[:cut], data[cut:]


def find_enwik8(data_dir: str | Path | None, train_file: str | Path | None) -> Path:
    """The enwik8 file: --train_file (the raw file or enwik8.zip), else DATA_DIR/enwik8 or DATA_DIR/enwik8.zip."""
    candidates = [Path(train_file)] if train_file else []
    if data_dir:
        candidates += [Path(data_dir) / "enwik8", Path(data_dir) / "enwik8.zip"]
    for path in candidates:
        if path.is_file():
            return path
    raise ValueError("enwik8 not found: pass --data_dir holding enwik8 or enwik8.zip (from "
                     "http://mattmahoney.net/dc/enwik8.zip), or --train_file pointing at either. The Hub copy "
                     "LTCB/enwik8 is a loading script that datasets >= 4 refuses.")


def read_enwik8(path: str | Path) -> torch.Tensor:
    """The raw bytes of enwik8 (the 100M-byte file, or the `enwik8` member of enwik8.zip)."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            member = "enwik8" if "enwik8" in names else names[0]
            return _as_byte_tensor(archive.read(member))
    return _as_byte_tensor(path.read_bytes())


def split_enwik8(data: torch.Tensor, heldout_bytes: int = ENWIK8_HELDOUT_BYTES) -> dict[str, torch.Tensor]:
    """train = all but the last 2*n bytes, validation = the n before the last n, test = the last n (bytes, not
    decoded characters: the split is exact and reproducible)."""
    if heldout_bytes < 1 or data.numel() <= 2 * heldout_bytes:
        raise ValueError(f"enwik8 holds {data.numel()} bytes, too few for 2 x --heldout_bytes={heldout_bytes} "
                         "held-out bytes; the real file has 100,000,000 (use the default 5,000,000).")
    n = heldout_bytes
    return {"train": data[: -2 * n], "validation": data[-2 * n: -n], "test": data[-n:]}


class TokenBlocks(Dataset):
    """Blocks of `block_size` tokens as `input_ids` (int64), starting every `stride` tokens (stride = block_size:
    non-overlapping; a short tail is dropped). Overlapping training windows are what t2t's enwik8-64K uses."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None):
        stride = stride or block_size
        if block_size < 2:
            raise ValueError(f"--block_size={block_size} is invalid: a causal LM needs at least 2 tokens per block.")
        if stride < 1:
            raise ValueError(f"--train_stride={stride} is invalid: set a positive stride (or 0 for block_size).")
        if tokens.numel() < block_size:
            raise ValueError(f"only {tokens.numel()} tokens for --block_size={block_size}; lower --block_size or "
                             "add data.")
        self.tokens = tokens
        self.block_size, self.stride = block_size, stride
        self.count = (tokens.numel() - block_size) // stride + 1

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        start = index * self.stride
        return {"input_ids": self.tokens[start: start + self.block_size].long()}


ByteBlocks = TokenBlocks  # the name the first version of train_lm.py used


class PasskeyDraws(Dataset):
    """`count` passkey retrieval sequences of `block_size` tokens (`input_ids`, and `answer_mask`: True on the answer
    tokens), drawn afresh for every epoch: item i of epoch e is drawn from a generator seeded by (seed, e, i), so a
    model never sees the same key twice in one place (it cannot memorise keys), and a resumed or multi-process run
    draws exactly what an uninterrupted one does. The training loop calls `set_epoch` (`loop.train_batches`).
    `min_distance`: see `attnzoo.evaluation.passkey.passkey_training_block`."""

    def __init__(self, tokenizer, block_size: int, count: int, seed: int, min_distance: int = 0):
        from attnzoo.evaluation.passkey import passkey_training_block  # evaluation code, only when asked for

        self.tokenizer, self.block_size, self.count, self.seed = tokenizer, block_size, count, seed
        self.min_distance, self.epoch, self._draw = min_distance, 0, passkey_training_block
        self[0]  # the arguments are checked here, not at the first batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        # a string seed is hashed with SHA-512 by `random`: the same draws in every process and Python run
        rng = random.Random(f"passkey/{self.seed}/{self.epoch}/{index}")
        ids, answer = self._draw(self.tokenizer, self.block_size, rng, task_description=False,
                                 min_distance=self.min_distance)
        return {"input_ids": ids, "answer_mask": answer}


class TextWithPasskeys(ConcatDataset):
    """Text blocks followed by passkey draws; every item has an `answer_mask` (all False on text) so that batches
    mixing the two collate, and the loss can weight the answers (`lm_loss.answer_weighted_lm_loss`)."""

    def __init__(self, text_set: Dataset, passkeys: PasskeyDraws):
        super().__init__([text_set, passkeys])
        self.passkeys = passkeys

    def set_epoch(self, epoch: int) -> None:
        self.passkeys.set_epoch(epoch)

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if "answer_mask" not in item:
            item = {**item, "answer_mask": torch.zeros(item["input_ids"].shape, dtype=torch.bool)}
        return item


def check_passkey_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--passkey_fraction={fraction} is invalid: set a fraction in [0, 1) of the training "
                         "sequences (0: text only).")


def check_passkey_options(fraction: float, min_distance: int, block_size: int,
                          answer_weight: float | None = None) -> None:
    """The passkey options: a fraction in [0, 1), a minimum distance that fits the block, a finite answer weight
    > 0; the options that shape the passkey sequences need some (nothing is silently ignored)."""
    check_passkey_fraction(fraction)
    if min_distance < 0 or (min_distance and min_distance >= block_size):
        raise ValueError(f"--passkey_min_distance={min_distance} is invalid: set 0 (any distance) or a number of "
                         f"tokens below --block_size={block_size}, such as the exact window's width.")
    # An infinite weight passes a "> 0" test, yet makes every passkey batch's loss non-finite: each such step would
    # be skipped and the run would end with an untrained model, so the weight must be finite as well as positive.
    if answer_weight is not None and not (math.isfinite(answer_weight) and answer_weight > 0):
        raise ValueError(f"--passkey_answer_weight={answer_weight} is invalid: set a finite, positive weight of the "
                         "answer tokens' loss (1: as any other token; 20-50 make small models learn retrieval).")
    unused = [name for name, value, default in (("--passkey_min_distance", min_distance, 0),
                                                ("--passkey_answer_weight", answer_weight, 1.0))
              if value is not None and value != default]
    if unused and not fraction:
        raise ValueError(f"{' and '.join(unused)} shape passkey sequences, and --passkey_fraction is 0: set "
                         "--passkey_fraction (e.g. 0.5) or drop them.")


def with_passkey_blocks(text_set: Dataset, fraction: float, tokenizer, block_size: int, seed: int,
                        min_distance: int = 0) -> Dataset:
    """The text blocks plus, for a passkey fraction f, f / (1 - f) passkey sequences per text block (each exactly
    `block_size` tokens, ending with its answer, drawn afresh every epoch: `PasskeyDraws`), so a model learns on data
    that needs retrieval from anywhere in the context ("LoLA", arXiv 2505.23666, finds that conversions keep only
    what their training data exercises)."""
    if not fraction:
        return text_set
    count = round(len(text_set) * fraction / (1.0 - fraction))
    try:
        passkeys = PasskeyDraws(tokenizer, block_size, count, seed, min_distance)
    except ValueError as error:  # e.g. blocks too short to hold a key and its question
        raise ValueError(f"--passkey_fraction={fraction} with --block_size={block_size}: {error}") from error
    return TextWithPasskeys(text_set, passkeys)


def count_passkey_blocks(train_set: Dataset) -> int:
    """How many of a training set's sequences `with_passkey_blocks` added."""
    return len(train_set.passkeys) if isinstance(train_set, TextWithPasskeys) else 0


def tokenize_text_dataset(dataset, tokenizer, text_column: str, byte_level: bool) -> torch.Tensor:
    """Concatenate the rows of a `datasets` split into one token stream (documents separated by the tokenizer's
    EOS, or a newline for a byte-level tokenizer without one), as run_clm's `group_texts` does before cutting
    blocks."""
    if text_column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {text_column!r}; its columns are {dataset.column_names}. "
                         "Pass --text_column.")
    if byte_level and getattr(tokenizer, "eos_token_id", None) is None:  # no EOS (an older checkpoint's tokenizer)
        return _as_byte_tensor(b"\n".join(str(t).encode("utf-8") for t in dataset[text_column]))
    if byte_level:
        eos = torch.tensor([tokenizer.eos_token_id], dtype=torch.int32)
        return torch.cat([part for t in dataset[text_column]
                          for part in (_as_byte_tensor(str(t).encode("utf-8")).int(), eos)])
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encoded = dataset.map(lambda rows: {"ids": [tokenizer(t, add_special_tokens=False).input_ids + separator
                                                for t in rows[text_column]]},
                          batched=True, remove_columns=dataset.column_names, desc="tokenizing")
    return torch.tensor([i for ids in encoded["ids"] for i in ids], dtype=torch.int32)


def text_row_problem(row: dict, text_column: str) -> str | None:
    """What keeps a JSON row from holding text in `text_column` (None: nothing)."""
    if text_column not in row:
        return f"no '{text_column}' field (the row's fields: {sorted(row)}; pass --text_column)"
    if not isinstance(row[text_column], str):
        return f"'{text_column}' is a {type(row[text_column]).__name__}, not text"
    return None


def load_text_splits(args, tokenizer, byte_level: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, held-out tokens) for --corpus text: a `datasets` dataset (--dataset_name, or json/csv/
    parquet files), or raw text files read whole; held out = --validation_file, the dataset's validation split, or
    the last --heldout_fraction of the training text."""
    from datasets import load_dataset

    skip_bad = getattr(args, "skip_bad_examples", False)

    def encode_file(path):
        if byte_level:
            return read_bytes(path, skip_bad)
        text = default_corpus_text() if path is None else read_utf8_text(path, skip_bad)
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.int32)

    train_file, validation_file = args.train_file, args.validation_file
    is_raw_text = args.dataset_name is None and all(
        f is None or Path(f).suffix.lower() not in (".json", ".jsonl", ".csv", ".parquet")
        for f in (train_file, validation_file))
    if is_raw_text:
        for flag, path in (("--train_file", train_file), ("--validation_file", validation_file)):
            if path is not None and not Path(path).is_file():
                state = missing_file_reason(path)
                raise ValueError(f"{flag} {path} {state}; pass a text file (or omit --train_file for the default "
                                 "corpus).")
        train = encode_file(train_file)
        if validation_file:
            return train, encode_file(validation_file)
        return split_bytes(train, args.heldout_fraction)

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        missing = [f for f in files.values() if not Path(f).is_file()]
        if missing:
            raise ValueError(f"{missing} not found; pass existing --train_file / --validation_file paths.")
        extension = Path(train_file).suffix.lower().lstrip(".")
        if extension in ("json", "jsonl"):
            with checked_json_files(files, lambda row: text_row_problem(row, args.text_column), skip_bad,
                                    "text row") as checked:
                raw = load_dataset("json", data_files=checked)
        else:
            with utf8_text_files(files, skip_bad) as checked:
                raw = load_dataset(extension, data_files=checked)
    if "train" not in raw:
        raise ValueError(f"the dataset has splits {list(raw)}, no 'train' split.")
    train = tokenize_text_dataset(raw["train"], tokenizer, args.text_column, byte_level)
    if "validation" in raw:
        return train, tokenize_text_dataset(raw["validation"], tokenizer, args.text_column, byte_level)
    return split_bytes(train, args.heldout_fraction)
