"""Small natural-image patches for pixel-level generation on a CPU (a stand-in for imagenet64 that needs no download).

    python benchmarks/prepare_photo_patches.py --output_dir data/photo_patches --patch_size 16

The source is the photograph matplotlib ships (sample_data/grace_hopper.jpg), plus any `--images` given. Each photo
is downsampled by 2, 3 and 4 (box filter, as Downsampled-ImageNet is made), so patches show the scene at several
scales. Training patches come from the top 80% of each downsampled photo (random positions, half of them mirrored);
validation patches from the bottom 20% (a grid), so no validation pixel was seen in training. The output is uint8
[N, S, S, 3] arrays, train.npy and validation.npy, which scripts/train_lm.py reads with
`--corpus imagenet64 --train_file .../train.npy --validation_file .../validation.npy --image_size S`, with
info.json saying how they were made. Those three files are replaced only when the folder holds this script's patches
of the same setup; patches of another setup, or files of those names it did not make, are refused with nothing
written (the output-folder rule of benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from owned_outputs import Refused, exit_on_refusal  # noqa: E402

SCRIPT = "benchmarks/prepare_photo_patches"
OUTPUTS = ("train.npy", "validation.npy", "info.json")
#: what info.json records of the setup (the training count is its train shape's first entry)
INFO_SETUP = ("photos", "scales", "patch_size", "seed")
TRAIN_FRACTION = 0.8  # of each photo's rows; the rest is validation
SCALES = (2, 3, 4)


def default_photos() -> list[Path]:
    import matplotlib

    return [Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"]


def downsampled(path: Path, factor: int) -> np.ndarray:
    from PIL import Image

    image = Image.open(path).convert("RGB")
    size = (image.width // factor, image.height // factor)
    return np.asarray(image.resize(size, Image.Resampling.BOX), dtype=np.uint8)


def cut_patches(photos: list[Path], patch: int, train_count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train_regions, validation = [], []
    for path in photos:
        for factor in SCALES:
            pixels = downsampled(path, factor)
            split = int(pixels.shape[0] * TRAIN_FRACTION)
            top, bottom = pixels[:split], pixels[split:]
            if min(top.shape[:2]) < patch or min(bottom.shape[:2]) < patch:
                continue
            train_regions.append(top)
            step = patch // 2
            for y in range(0, bottom.shape[0] - patch + 1, step):
                for x in range(0, bottom.shape[1] - patch + 1, step):
                    validation.append(bottom[y:y + patch, x:x + patch])
    if not train_regions:
        raise ValueError(f"no photo is large enough for {patch}x{patch} patches at downsampling {SCALES}; "
                         "lower --patch_size or pass larger --images.")
    train = []
    for i in range(train_count):
        region = train_regions[i % len(train_regions)]
        y = rng.integers(0, region.shape[0] - patch + 1)
        x = rng.integers(0, region.shape[1] - patch + 1)
        crop = region[y:y + patch, x:x + patch]
        train.append(crop[:, ::-1] if rng.random() < 0.5 else crop)
    return np.stack(train), np.stack(validation)


def check_output_dir(folder: Path, setup: dict) -> None:
    """Before anything is cut: `folder` holds none of the files this script writes, or this script's patches of the
    same setup (replaced); anything else is refused, naming the folder and the fix."""
    found = [name for name in OUTPUTS if (folder / name).exists()]
    if not found:
        return
    try:
        info = json.loads((folder / "info.json").read_text())
        earlier = {**{k: info[k] for k in INFO_SETUP}, "train_patches": info["train"][0]}
    except (OSError, ValueError, TypeError, KeyError, IndexError):  # missing, not JSON, not this script's record
        raise Refused(f"--output_dir {folder} holds {', '.join(found)}, which {SCRIPT}.py did not make (no info.json "
                      "of its own beside them); they are left as they are and nothing was written. Pick another "
                      "--output_dir (or move those files away).") from None
    if earlier != json.loads(json.dumps(setup)):
        raise Refused(f"--output_dir {folder} holds patches of another setup ({earlier}, this run: {setup}); they are "
                      "left as they are and nothing was written. Pick another --output_dir (or move them away).")


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", type=Path, default=Path("data/photo_patches"))
    p.add_argument("--patch_size", type=int, default=16)
    p.add_argument("--train_patches", type=int, default=20000)
    p.add_argument("--images", type=Path, nargs="*", default=[], help="more photos (any format PIL reads)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    photos = default_photos() + list(args.images)
    missing = [str(x) for x in photos if not x.is_file()]
    if missing:
        raise ValueError(f"photos not found: {missing}")
    check_output_dir(args.output_dir, {"photos": [x.name for x in photos], "scales": SCALES,
                                       "patch_size": args.patch_size, "seed": args.seed,
                                       "train_patches": args.train_patches})
    train, validation = cut_patches(photos, args.patch_size, args.train_patches, args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    np.save(args.output_dir / "train.npy", train)
    np.save(args.output_dir / "validation.npy", validation)
    info = {"photos": [x.name for x in photos], "scales": SCALES, "patch_size": args.patch_size,
            "train": list(train.shape), "validation": list(validation.shape), "seed": args.seed}
    (args.output_dir / "info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
