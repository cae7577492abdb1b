"""Images as data: uint8 [H, W, 3] arrays from numpy files (.npy / .npz, e.g. the Downsampled-ImageNet 64x64
release), image folders, or a `datasets` dataset; and their pixel-level language-modelling form (imagenet64).

Pixel LM (Reformer, arXiv 2001.04451, §5, imagenet64): an image is its H*W*3 sub-pixels in raster order (row, column,
channel), each a 256-way token. A start token (id 256) is prepended so that every sub-pixel, the first included, is
predicted: input_ids = [256, x_0, ..., x_{n-1}], labels = [-100, x_0, ..., x_{n-1}]; the model therefore needs
vocab_size 257 and max_position_embeddings n + 1 (12,289 for 64x64). bits/dim = summed NLL / (n * ln 2) over all
sub-pixels.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnzoo.training.data_checks import ImageReader, dataset_image_location

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
PIXEL_START_TOKEN = 256
PIXEL_VOCAB_SIZE = 257


def to_hwc_uint8(array: np.ndarray, image_size: int) -> np.ndarray:
    """[N, S, S, 3] (HWC), [N, 3, S, S] (CHW) or [N, 3*S*S] (planar rows, the Downsampled-ImageNet .npz layout:
    all red values, then green, then blue) -> uint8 [N, S, S, 3]."""
    array = np.asarray(array)
    s = image_size
    if array.ndim == 2 and array.shape[1] == 3 * s * s:
        array = array.reshape(-1, 3, s, s).transpose(0, 2, 3, 1)
    elif array.ndim == 4 and array.shape[1:] == (3, s, s):
        array = array.transpose(0, 2, 3, 1)
    elif not (array.ndim == 4 and array.shape[1:] == (s, s, 3)):
        raise ValueError(f"image array of shape {array.shape} does not hold {s}x{s} RGB images; expected "
                         f"[N, {s}, {s}, 3], [N, 3, {s}, {s}] or [N, {3 * s * s}] (or change --image_size).")
    if array.dtype != np.uint8:
        if array.min() < 0 or array.max() > 255:
            raise ValueError("image arrays must hold 8-bit values in [0, 255].")
        array = array.astype(np.uint8)
    return array


def expand_files(pattern: str) -> list[Path]:
    """A file, a comma-separated list, or glob patterns, e.g. 'Imagenet64_train_npz/*.npz'."""
    paths = []
    for part in [p.strip() for p in pattern.split(",") if p.strip()]:
        matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        paths += [Path(m) for m in matches]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise ValueError(f"no image array files found for {pattern!r} (missing: {missing}); pass .npy/.npz paths "
                         "or a glob pattern.")
    return paths


class ArrayImages(Dataset):
    """Images held in numpy arrays (.npy files are memory-mapped, so the whole set need not fit in RAM)."""

    def __init__(self, files: list[Path], image_size: int, array_key: str = "data"):
        self.parts = []
        for path in files:
            if path.suffix == ".npz":
                with np.load(path) as archive:
                    key = array_key if array_key in archive else archive.files[0]
                    self.parts.append(to_hwc_uint8(archive[key], image_size))
            elif path.suffix == ".npy":
                self.parts.append(to_hwc_uint8(np.load(path, mmap_mode="r"), image_size))
            else:
                raise ValueError(f"{path}: image arrays must be .npy or .npz files.")
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, index) -> np.ndarray:
        part = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return np.asarray(self.parts[part][index - self.offsets[part]])


def resize_rgb(image, image_size: int) -> np.ndarray:
    """A PIL image -> uint8 [S, S, 3], the whole image box-filtered to S x S (how Downsampled ImageNet was made:
    no crop, so the aspect ratio changes)."""
    from PIL import Image

    image = image.convert("RGB")
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.BOX)
    return np.asarray(image, dtype=np.uint8)


class FolderImages(Dataset):
    """Every image file under a folder (recursively, sorted), decoded and resized when read; a file that does not
    decode raises ValueError naming it, or with `skip_bad` is replaced by the next readable one."""

    def __init__(self, folder: str | Path, image_size: int, skip_bad: bool = False):
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"image folder {folder} does not exist.")
        self.paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.paths:
            raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}.")
        self.image_size = image_size
        self.read_image = ImageReader(self._decode, len(self.paths), self._location, skip_bad)

    def __len__(self):
        return len(self.paths)

    def _location(self, index: int) -> str:
        return str(self.paths[index])

    def _decode(self, index: int) -> np.ndarray:
        from PIL import Image

        with Image.open(self.paths[index]) as image:
            return resize_rgb(image, self.image_size)

    def __getitem__(self, index) -> np.ndarray:
        return self.read_image(int(index))


class HubImages(Dataset):
    """The image column of a `datasets` split (PIL images or arrays), resized when read."""

    def __init__(self, split, image_column: str, image_size: int, skip_bad: bool = False):
        if image_column not in split.column_names:
            raise ValueError(f"the dataset has no column {image_column!r}; its columns are {split.column_names}. "
                             "Pass --image_column.")
        self.split, self.column, self.image_size = split, image_column, image_size
        self.read_image = ImageReader(self._decode, len(split), self._location, skip_bad)

    def __len__(self):
        return len(self.split)

    def _location(self, index: int) -> str:
        return dataset_image_location(self.split, self.column, index)

    def _decode(self, index: int) -> np.ndarray:
        image = self.split[index][self.column]
        if hasattr(image, "convert"):
            return resize_rgb(image, self.image_size)
        return to_hwc_uint8(np.asarray(image)[None], self.image_size)[0]

    def __getitem__(self, index) -> np.ndarray:
        return self.read_image(int(index))


def load_image_sources(args) -> tuple[Dataset, Dataset]:
    """(train, held-out) uint8 image datasets for the pixel LM from --train_file/--validation_file (.npy/.npz),
    --train_dir/--validation_dir (image folders) or --dataset_name (a `datasets` dataset)."""
    size = args.image_size
    skip_bad = getattr(args, "skip_bad_examples", False)
    if args.dataset_name:
        from datasets import load_dataset

        raw = load_dataset(args.dataset_name, args.dataset_config_name)
        heldout = "validation" if "validation" in raw else "test" if "test" in raw else None
        if "train" not in raw or heldout is None:
            raise ValueError(f"{args.dataset_name} has splits {list(raw)}; it needs 'train' and 'validation' (or "
                             "'test').")
        return (HubImages(raw["train"], args.image_column, size, skip_bad),
                HubImages(raw[heldout], args.image_column, size, skip_bad))
    if args.train_file:
        if not args.validation_file:
            raise ValueError("--corpus imagenet64 with --train_file needs --validation_file (the held-out images).")
        return (ArrayImages(expand_files(args.train_file), size),
                ArrayImages(expand_files(args.validation_file), size))
    if args.train_dir:
        if not args.validation_dir:
            raise ValueError("--train_dir needs --validation_dir (the held-out images).")
        return FolderImages(args.train_dir, size, skip_bad), FolderImages(args.validation_dir, size, skip_bad)
    raise ValueError("--corpus imagenet64 needs images: --train_file/--validation_file (.npy/.npz arrays, e.g. "
                     "Imagenet64_train_npz/*.npz), --train_dir/--validation_dir (image folders) or --dataset_name.")


class PixelSequences(Dataset):
    """Images as start-token + sub-pixel sequences for a causal LM (see the module docstring)."""

    def __init__(self, images: Dataset):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        pixels = torch.from_numpy(np.array(self.images[index], dtype=np.uint8)).reshape(-1).long()  # a copy
        input_ids = torch.cat([torch.tensor([PIXEL_START_TOKEN]), pixels])
        labels = input_ids.clone()
        labels[0] = -100
        return {"input_ids": input_ids, "labels": labels}


def pixel_sequence_length(image_size: int) -> int:
    return image_size * image_size * 3 + 1
