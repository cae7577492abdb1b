"""Build a small real English→German parallel corpus from the system's gettext catalogs (no download).

Debian/Ubuntu images ship translated messages of their packages in /usr/share/locale/de/LC_MESSAGES/*.mo
(coreutils, bash, apt, tar, ...): tens of thousands of real en-de pairs. They are GPL/LGPL translations, so the
corpus is generated on the machine that uses it and never committed. Output: train/validation/test JSON lines in
the WMT schema ({"translation": {"de": ..., "en": ...}}), split by a hash of the English text (deterministic).

    python scripts/prepare_gettext_corpus.py --output_dir data/gettext-en-de
"""

from __future__ import annotations

import argparse
import gettext
import hashlib
import json
import re
from pathlib import Path

DEFAULT_LOCALE_DIR = "/usr/share/locale/de/LC_MESSAGES"
PLACEHOLDER = re.compile(r"%|\$\{|\{\w*\}|\\")


def read_catalog_pairs(locale_dir: str | Path) -> dict[str, str]:
    """English message -> German translation over every readable .mo file (first translation wins)."""
    pairs: dict[str, str] = {}
    for path in sorted(Path(locale_dir).glob("*.mo")):
        try:
            with path.open("rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError):  # bad magic number, a non-UTF-8 catalog
            continue
        for source, target in catalog.items():
            if isinstance(source, tuple) or not isinstance(target, str):  # plural forms
                continue
            pairs.setdefault(source, target)
    return pairs


def clean(pairs: dict[str, str], max_chars: int) -> list[tuple[str, str]]:
    """Sentence-like messages: a space (several words), no printf/shell placeholders, one line, not too long."""
    kept = []
    for en, de in pairs.items():
        en, de = " ".join(en.split()), " ".join(de.split())
        if (" " in en and en != de and de and not PLACEHOLDER.search(en) and not PLACEHOLDER.search(de)
                and len(en) <= max_chars and len(de) <= max_chars and "\n" not in en + de):
            kept.append((en, de))
    return sorted(set(kept))


def split_of(english: str, validation_per_mille: int, test_per_mille: int) -> str:
    bucket = int(hashlib.sha1(english.encode()).hexdigest(), 16) % 1000
    if bucket < validation_per_mille:
        return "validation"
    if bucket < validation_per_mille + test_per_mille:
        return "test"
    return "train"


def write_corpus(output_dir: str | Path, locale_dir: str | Path = DEFAULT_LOCALE_DIR, max_chars: int = 120,
                 validation_per_mille: int = 20, test_per_mille: int = 20, max_pairs: int = 0) -> dict[str, int]:
    pairs = clean(read_catalog_pairs(locale_dir), max_chars)
    if max_pairs:
        pairs = pairs[:max_pairs]
    if len(pairs) < 100:
        raise ValueError(f"only {len(pairs)} usable en-de pairs under {locale_dir}; install German language packs "
                         "(e.g. the 'locales-all' or packages' translations) or pass --locale_dir.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {split: (output_dir / f"{split}.jsonl").open("w", encoding="utf-8")
             for split in ("train", "validation", "test")}
    counts = dict.fromkeys(files, 0)
    for en, de in pairs:
        split = split_of(en, validation_per_mille, test_per_mille)
        files[split].write(json.dumps({"translation": {"de": de, "en": en}}, ensure_ascii=False) + "\n")
        counts[split] += 1
    for f in files.values():
        f.close()
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="data/gettext-en-de")
    parser.add_argument("--locale_dir", default=DEFAULT_LOCALE_DIR)
    parser.add_argument("--max_chars", type=int, default=120)
    parser.add_argument("--max_pairs", type=int, default=0, help="keep the first N pairs (0: all)")
    args = parser.parse_args(argv)
    counts = write_corpus(args.output_dir, args.locale_dir, args.max_chars, max_pairs=args.max_pairs)
    print(f"wrote {counts} pairs to {args.output_dir}")
    return counts


if __name__ == "__main__":
    main()
