"""Build a small offline image-classification set: the digits 0-9 rendered in the fonts matplotlib ships.

Each image is one digit drawn in one of 17 typefaces (DejaVu Sans/Serif/Mono and STIX in regular, bold, italic,
Computer Modern), at a random size, rotation and position, in dark ink of a random colour on light paper of a random
colour, with pixel noise: an MNIST-like 10-class task in colour. The output is an image folder
(OUTPUT_DIR/{train,validation}/{digit}/*.png) that `datasets`' imagefolder (and
scripts/train_image_classification.py --train_dir/--validation_dir) reads. Training and validation use disjoint
random draws; the fonts are shared (this tests learning glyph shapes, not font transfer).

    python scripts/prepare_glyph_images.py --output_dir data/glyphs --image_size 32 --train_per_class 200
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
              "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf",
              "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf", "STIXGeneral.ttf",
              "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf")


def font_paths() -> list[Path]:
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return [folder / name for name in FONT_FILES if (folder / name).is_file()]


def render_digit(digit: int, size: int, rng: random.Random, fonts: list[Path]):
    from PIL import Image, ImageDraw, ImageFont

    scale = 4  # draw large, then downsample: smooth edges at small sizes
    canvas = size * scale
    background = tuple(rng.randrange(150, 256) for _ in range(3))  # a light colour
    foreground = tuple(rng.randrange(0, 100) for _ in range(3))  # a dark one: ink on paper, in colour
    image = Image.new("RGB", (canvas, canvas), background)
    font = ImageFont.truetype(str(rng.choice(fonts)), size=int(canvas * rng.uniform(0.55, 0.85)))
    glyph = Image.new("L", (canvas, canvas), 0)
    ImageDraw.Draw(glyph).text((canvas / 2, canvas / 2), str(digit), fill=255, font=font, anchor="mm")
    glyph = glyph.rotate(rng.uniform(-20, 20), resample=Image.BICUBIC,
                         translate=(rng.uniform(-0.12, 0.12) * canvas, rng.uniform(-0.12, 0.12) * canvas))
    image.paste(Image.new("RGB", (canvas, canvas), foreground), mask=glyph)
    image = image.resize((size, size), Image.LANCZOS)
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 8, (size, size, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float64) + noise, 0, 255).astype(np.uint8))


def write_glyph_folder(output_dir: str | Path, image_size: int = 32, train_per_class: int = 200,
                       validation_per_class: int = 50, seed: int = 0) -> dict[str, int]:
    fonts = font_paths()
    if not fonts:
        raise ValueError("matplotlib's fonts were not found; install matplotlib.")
    counts = {}
    for split, per_class, split_seed in (("train", train_per_class, seed), ("validation", validation_per_class,
                                                                            seed + 1)):
        rng = random.Random(split_seed)
        for digit in range(10):
            folder = Path(output_dir) / split / str(digit)
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(per_class):
                render_digit(digit, image_size, rng, fonts).save(folder / f"{index:05d}.png")
        counts[split] = 10 * per_class
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="data/glyphs")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--train_per_class", type=int, default=200)
    parser.add_argument("--validation_per_class", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = write_glyph_folder(args.output_dir, args.image_size, args.train_per_class, args.validation_per_class,
                                args.seed)
    print(f"wrote {counts} images to {args.output_dir}")
    return counts


if __name__ == "__main__":
    main()
