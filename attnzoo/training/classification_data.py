"""Labelled images for classification: an image folder (one sub-folder per class, read by `datasets`' imagefolder)
or a `datasets` dataset (e.g. ImageNet-1k: `image` and `label` columns), with a transform applied when read.

The transforms themselves (timm's DeiT augmentation) live in scripts/train_image_classification.py, since timm and
torchvision are the optional `vision` extra."""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnzoo.training.data_checks import ImageReader, dataset_image_location


def load_labelled_images(args):
    """(DatasetDict with 'train' and 'validation', label names)."""
    from datasets import ClassLabel, load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    elif args.train_dir:
        for folder in (args.train_dir, args.validation_dir):
            if folder and not Path(folder).is_dir():
                raise ValueError(f"image folder {folder} does not exist.")
        files = {"train": str(Path(args.train_dir) / "**")}
        if args.validation_dir:
            files["validation"] = str(Path(args.validation_dir) / "**")
        raw = load_dataset("imagefolder", data_files=files)
    else:
        raise ValueError("pass --train_dir (and --validation_dir): image folders with one sub-folder per class, or "
                         "--dataset_name (e.g. imagenet-1k).")
    if "train" not in raw:
        raise ValueError(f"the dataset has splits {list(raw)}, no 'train' split.")
    if "validation" not in raw:
        if "test" in raw and args.label_column in raw["test"].column_names:
            raw["validation"] = raw["test"]
        else:  # hold out a stratification-free random share, fixed by the seed
            parts = raw["train"].train_test_split(test_size=args.train_val_split, seed=args.seed)
            raw["train"], raw["validation"] = parts["train"], parts["test"]
    for column in (args.image_column, args.label_column):
        if column not in raw["train"].column_names:
            raise ValueError(f"the dataset has no column {column!r}; its columns are {raw['train'].column_names}. "
                             "Pass --image_column / --label_column.")
    if not isinstance(raw["train"].features[args.label_column], ClassLabel):  # e.g. string labels in a csv/json
        raw["train"] = raw["train"].class_encode_column(args.label_column)
        raw["validation"] = raw["validation"].cast_column(args.label_column, raw["train"].features[args.label_column])
    names = list(raw["train"].features[args.label_column].names)
    if len(names) < 2:
        raise ValueError(f"found {len(names)} class(es); classification needs at least 2 (one folder per class).")
    for split in ("train", "validation"):
        limit = args.max_train_samples if split == "train" else args.max_eval_samples
        if limit:
            raw[split] = raw[split].shuffle(seed=args.seed).select(range(min(limit, len(raw[split]))))
    return raw, names


@contextmanager
def isolated_rng(seed: int):
    """Seed python's, numpy's and torch's global RNGs for the block, then put their previous states back."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class TransformedImages(Dataset):
    """Rows as {"pixel_values": transform(RGB image), "labels": int}.

    Random augmentation (timm's RandAugment and random erasing draw from the global RNGs) runs under a seed derived
    from (seed, epoch, example index), so an example's augmentation does not depend on when it is loaded: accelerate's
    loader reads one batch ahead, so a checkpoint is saved after the next batch was already augmented, and a resumed
    run (or a different number of processes or workers) would otherwise augment differently. The global RNG stream
    that dropout, drop path and Mixup use is left untouched. `set_epoch` is called by accelerate's loader.
    """

    def __init__(self, split, transform, image_column: str, label_column: str, seed: int = 0,
                 skip_bad: bool = False):
        self.split, self.transform = split, transform
        self.image_column, self.label_column = image_column, label_column
        self.seed, self.epoch = seed, 0
        self.read_example = ImageReader(self._decode, len(split), self._location, skip_bad)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return len(self.split)

    def _decode(self, index: int):
        row = self.split[index]
        return row[self.image_column].convert("RGB"), int(row[self.label_column])

    def _location(self, index: int) -> str:
        return dataset_image_location(self.split, self.image_column, index)

    def __getitem__(self, index):
        image, label = self.read_example(int(index))  # an unreadable image: named, or replaced with skip_bad
        example_seed = ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + int(index)) % (1 << 63)
        with isolated_rng(example_seed):
            pixels = self.transform(image)
        return {"pixel_values": pixels, "labels": label}


def with_transform(split, transform, image_column: str, label_column: str, seed: int = 0,
                   skip_bad: bool = False) -> TransformedImages:
    return TransformedImages(split, transform, image_column, label_column, seed, skip_bad)


def collate_images(examples) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([int(e["labels"]) for e in examples], dtype=torch.long)}
