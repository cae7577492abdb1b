"""Labelled images for classification: an image folder (one sub-folder per class, read by `datasets`' imagefolder)
or a `datasets` dataset (e.g. ImageNet-1k: `image` and `label` columns), with a transform applied when read.

The transforms themselves (timm's DeiT augmentation) live in scripts/train_image_classification.py, since timm and
torchvision are the optional `vision` extra."""

from __future__ import annotations

from pathlib import Path

import torch


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


def with_transform(split, transform, image_column: str, label_column: str):
    """Rows become {"pixel_values": transform(RGB image), "labels": int} when read (lazily, per batch)."""
    def apply(batch):
        return {"pixel_values": [transform(image.convert("RGB")) for image in batch[image_column]],
                "labels": list(batch[label_column])}

    return split.with_transform(apply)


def collate_images(examples) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([int(e["labels"]) for e in examples], dtype=torch.long)}
