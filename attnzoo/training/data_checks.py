"""Malformed training data, found before (or when) it is used and reported by file and line or item: JSON-lines files
(a line that is not JSON or not UTF-8, a missing field), text and CSV files that are not UTF-8, and image files that
do not decode. By default the first problems stop the run with a ValueError naming them; with --skip_bad_examples the
bad examples are left out and counted in a warning."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

SHOWN = 5  # bad lines named in a message
SKIP_HINT = "pass --skip_bad_examples to leave such examples out"


class BadExample(NamedTuple):
    location: str  # "path:line" or "path (item i)"
    problem: str


def missing_file_reason(path: str | Path) -> str:
    """Why `path` is not a data file to read: it is a folder, it is not a regular file (a device such as /dev/null,
    a pipe or a socket), or it does not exist."""
    path = Path(path)
    if path.is_dir():
        return "is a folder"
    if path.exists():
        return "is not a regular file (a device, pipe or socket)"
    return "does not exist"


def _summary(bad: list[BadExample]) -> str:
    shown = "; ".join(f"{b.location}: {b.problem}" for b in bad[:SHOWN])
    return shown + (f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")


def is_json_lines(path: str | Path) -> bool:
    """A .jsonl file, or a .json file whose first non-blank line is a whole JSON object (not one JSON document)."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return True
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:
                    return False
    return True


def bad_json_lines(path: str | Path, row_problem: Callable[[dict], str | None]) -> tuple[int, list[BadExample]]:
    """(number of rows, the bad ones) of a JSON-lines file: lines that are not UTF-8, not a JSON object, or that
    `row_problem` rejects (it returns what is wrong with a parsed row, or None). Blank lines are ignored, as
    `datasets` does."""
    bad, rows = [], 0
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            rows += 1
            location = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad.append(BadExample(location, f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"))
                continue
            try:
                row = json.loads(text)
            except ValueError as err:
                bad.append(BadExample(location, f"not valid JSON ({err})"))
                continue
            problem = "not a JSON object" if not isinstance(row, dict) else row_problem(row)
            if problem:
                bad.append(BadExample(location, problem))
    return rows, bad


def check_json_document(path: str | Path) -> None:
    """A whole-document .json file (not JSON lines) must parse; the error names its line and column."""
    try:
        json.loads(Path(path).read_bytes())
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 at byte {err.start}; convert the file to UTF-8.") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); fix the file.") from err


@contextmanager
def checked_json_files(files: dict[str, str | Path], row_problem: Callable[[dict], str | None], skip_bad: bool,
                       what: str) -> Iterator[dict[str, str]]:
    """The JSON(-lines) `files` ({split: path}) after checking every line: a bad line raises ValueError naming the
    file and line (the first few of them); with `skip_bad`, the split is given as a copy without the bad lines (in a
    temporary folder that lives as long as the context: load the data inside it) and a warning counts them.
    `what` names a row in messages, e.g. "translation pair"."""
    clean: dict[str, str] = {}
    folder = None
    try:
        for split, path in files.items():
            if not is_json_lines(path):
                check_json_document(path)
                clean[split] = str(path)
                continue
            rows, bad = bad_json_lines(path, row_problem)
            if not bad:
                clean[split] = str(path)
                continue
            if not skip_bad or len(bad) == rows:
                raise ValueError(f"{len(bad)} malformed {what}(s) of {rows} in {path}: {_summary(bad)}. Fix or remove "
                                 f"those lines{'' if len(bad) == rows else ', or ' + SKIP_HINT}.")
            folder = folder or Path(tempfile.mkdtemp(prefix="attnzoo-clean-"))
            clean[split] = str(_copy_without_lines(Path(path), {int(b.location.rsplit(":", 1)[1]) for b in bad},
                                                   folder / f"{split}.jsonl"))
            logger.warning(f"skipped {len(bad)} malformed {what}(s) in {path} (--skip_bad_examples): {_summary(bad)}")
        yield clean
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _copy_without_lines(source: Path, dropped: set[int], target: Path) -> Path:
    with source.open("rb") as src, target.open("wb") as dst:
        for number, raw in enumerate(src, 1):
            if number not in dropped:
                dst.write(raw)
    return target


def _bad_utf8_lines(path: str | Path) -> list[BadExample]:
    """The lines of a file that are not UTF-8, read one line at a time (a CSV can be larger than memory)."""
    bad = []
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad.append(BadExample(f"{path}:{number}", f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                                          f"{err.start + 1}: {err.reason})"))
    return bad


@contextmanager
def utf8_text_files(files: dict[str, str | Path], skip_bad: bool) -> Iterator[dict[str, str]]:
    """Delimited text files (CSV, TSV) checked to be UTF-8 before a `datasets` loader reads them (its own error names
    neither file nor line): lines that are not UTF-8 raise ValueError naming file and line; with `skip_bad`, the split
    is given as a copy without those lines, in a temporary folder that lives as long as the context."""
    clean: dict[str, str] = {}
    folder = None
    try:
        for split, path in files.items():
            bad = _bad_utf8_lines(path)
            if not bad:
                clean[split] = str(path)
                continue
            if not skip_bad:
                raise ValueError(f"{_summary(bad)}. Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), or "
                                 f"{SKIP_HINT} (its lines that are not UTF-8).")
            folder = folder or Path(tempfile.mkdtemp(prefix="attnzoo-clean-"))
            clean[split] = str(_copy_without_lines(Path(path), {int(b.location.rsplit(":", 1)[1]) for b in bad},
                                                   folder / f"{split}{Path(path).suffix}"))
            logger.warning(f"skipped {len(bad)} line(s) of {path} that are not UTF-8 (--skip_bad_examples): "
                           f"{_summary(bad)}")
        yield clean
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def read_utf8_text(path: str | Path, skip_bad: bool) -> str:
    """A text file decoded as UTF-8. Bytes that are not UTF-8 raise ValueError naming the file, line and byte
    offset; with `skip_bad`, the lines holding them are dropped and counted in a warning."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        first = err
    line = data.count(b"\n", 0, first.start) + 1
    if not skip_bad:
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[first.start]:02x} at offset {first.start}: "
                         f"{first.reason}). Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), or "
                         f"{SKIP_HINT} (its lines that are not UTF-8).")
    kept, dropped = [], []
    for number, raw in enumerate(data.splitlines(keepends=True), 1):
        try:
            kept.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            dropped.append(number)
    logger.warning(f"skipped {len(dropped)} line(s) of {path} that are not UTF-8 (--skip_bad_examples): lines "
                   f"{dropped[:SHOWN]}{' ...' if len(dropped) > SHOWN else ''}")
    return "".join(kept)


def dataset_image_location(split, image_column: str, index: int) -> str:
    """The file an image of a `datasets` split came from (imagefolder keeps its path), else its item number."""
    from datasets import Image

    try:
        item = split.select([index]).cast_column(image_column, Image(decode=False))[0][image_column]
        path = item.get("path") if isinstance(item, dict) else None
    except Exception:  # naming the image must not hide the decoding error being reported
        path = None
    return f"{path} (item {index})" if path else f"item {index} of the image dataset"


class ImageReader:
    """Reads item `index` of an image dataset with `read(index)`. An image that does not decode raises ValueError
    naming it (`describe(index)`: its file, or the item); with `skip_bad` the next readable item is returned instead
    (a fixed substitute, so resumed runs see the same data) and a warning names each skipped image.

    Only `read`, which should do nothing but open and decode the image, is guarded: Pillow reports damaged files
    with many exception types (OSError, SyntaxError, ValueError, EOFError, zlib errors)."""

    def __init__(self, read: Callable[[int], object], length: int, describe: Callable[[int], str], skip_bad: bool):
        self.read, self.length, self.describe, self.skip_bad = read, length, describe, skip_bad
        self.skipped: set[int] = set()

    def __call__(self, index: int):
        for offset in range(self.length):
            candidate = (index + offset) % self.length
            if candidate in self.skipped:
                continue
            try:
                return self.read(candidate)
            except Exception as err:  # only image decoding runs here (see the class docstring)
                problem = f"{self.describe(candidate)}: unreadable image ({type(err).__name__}: {err})"
                if not self.skip_bad:
                    raise ValueError(f"{problem}. Replace or remove the file, or {SKIP_HINT}.") from err
                self.skipped.add(candidate)
                logger.warning(f"skipped {problem} (--skip_bad_examples; {len(self.skipped)} skipped so far in "
                               "this process)")
        raise ValueError(f"no image of the dataset could be read ({len(self.skipped)} tried); check the files.")
