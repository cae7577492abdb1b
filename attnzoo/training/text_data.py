"""Byte-level text data: a corpus read as raw bytes, split into train / held-out, cut into fixed-length blocks."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


def default_corpus_path() -> Path:
    """English text every CPython ships (the pydoc topic index, ~470 KB), so the quick-start needs no download."""
    import pydoc_data

    return Path(pydoc_data.__path__[0]) / "topics.py"


def read_bytes(path: str | Path | None) -> torch.Tensor:
    path = Path(path) if path is not None else default_corpus_path()
    if not path.is_file():
        raise ValueError(f"--train_file {path} does not exist; pass a text file (or omit it for the default corpus).")
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    if data.numel() < 1024:
        raise ValueError(f"{path} holds {data.numel()} bytes; a byte-level LM needs at least 1 KB of text.")
    return data


def split_bytes(data: torch.Tensor, heldout_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - fraction) of the bytes train, the rest is held out (contiguous, as for enwik8)."""
    if not 0.0 < heldout_fraction < 0.5:
        raise ValueError(f"--heldout_fraction={heldout_fraction} must be in (0, 0.5).")
    cut = int(data.numel() * (1.0 - heldout_fraction))
    return data[:cut], data[cut:]


class ByteBlocks(Dataset):
    """Non-overlapping blocks of `block_size` bytes as `input_ids` (int64); a short tail is dropped."""

    def __init__(self, data: torch.Tensor, block_size: int):
        if data.numel() < block_size:
            raise ValueError(f"only {data.numel()} bytes for block_size={block_size}; lower --block_size.")
        self.blocks = data[: data.numel() // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, index):
        return {"input_ids": self.blocks[index].long()}
