"""What a `--model_name_or_path` (or a converter's SRC) names, checked before transformers reads it: transformers
would answer a missing folder with "Repo id must be ..." and a training checkpoint with "Should have a model_type",
neither of which says what is wrong. A name that is not a local path is left to transformers (a Hub id).

A GGUF checkpoint (llama.cpp's single-file format: a `.gguf` file, or a folder holding exactly one and no config.json)
is read only where a caller says it takes one (`attnzoo.convert.llama`'s SRC): there transformers' own GGUF loader
dequantises it into a plain transformers model (`load_gguf_model`) and builds its tokenizer from the file's metadata
(`load_gguf_tokenizer`). Everywhere else a GGUF is refused with the conversion that turns it into a saved folder.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path

from attnzoo.training.checkpoints import MANIFEST, STEP_DIR

GGUF_SUFFIX = ".gguf"
GGUF_INSTALL = "pip install 'attnzoo[gguf]'"


def gguf_checkpoint(name: str | Path, flag: str = "--model_name_or_path") -> Path | None:
    """The GGUF file `name` names: `name` itself if it is a `.gguf` file, or the one `.gguf` in a folder without a
    config.json (a folder with a config.json is a saved model, read as such whatever else it holds; name the
    `.gguf` itself to read that). None for anything else. A folder with several `.gguf` files (quantisations of one
    model usually ship side by side) raises ValueError: which one is meant is the user's choice."""
    path = Path(name)
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(file for file in path.glob(f"*{GGUF_SUFFIX}") if file.is_file())
    if len(found) > 1:
        raise ValueError(f"{flag} {name} holds {len(found)} GGUF files ({', '.join(file.name for file in found)}); "
                         f"pass the one to read as {flag}, e.g. {flag} {found[0]}.")
    return found[0] if found else None


def gguf_refused_message(name: str | Path, gguf: Path, flag: str) -> str:
    return (f"{flag} {name} is a GGUF checkpoint ({gguf.name}), which {flag} does not read: it takes a folder that "
            "save_pretrained wrote, or a Hub id. Convert the GGUF first: `python -m attnzoo.convert.llama "
            f"{name} DST --family softmax` writes the same model (dequantised) with its tokenizer as such a folder "
            f"(another --family also changes its attention); then pass DST as {flag}.")


def check_model_source(name: str | Path, flag: str = "--model_name_or_path", takes_gguf: bool = False) -> None:
    """Raise ValueError when `name` is a local path that holds no saved model, saying what it holds instead. A GGUF
    checkpoint (`gguf_checkpoint`) passes where `takes_gguf`, and is refused, with the conversion to run, where
    not."""
    path = Path(name)
    looks_local = path.exists() or str(name).startswith((".", "/", "~")) or len(path.parts) > 2 or path.suffix != ""
    if not looks_local:
        return  # a Hub id ("user/model"): transformers resolves it
    if not path.exists():
        raise ValueError(f"{flag} {name}: no such folder. Pass a folder that save_pretrained wrote (a training run's "
                         "--output_dir) or a Hub id.")
    gguf = gguf_checkpoint(name, flag)
    if gguf is not None:
        if takes_gguf:
            return
        raise ValueError(gguf_refused_message(name, gguf, flag))
    if not path.is_dir():
        also = f", or a {GGUF_SUFFIX} file" if takes_gguf else ""
        raise ValueError(f"{flag} {name} is a file; pass the folder that holds it (with its config.json){also}.")
    if (path / "config.json").is_file():
        _check_weights(path, flag)
        return
    if STEP_DIR.match(path.name) or (path / MANIFEST).is_file():
        run = path.parent.parent
        raise ValueError(f"{flag} {name} is a training checkpoint (optimizer and RNG state for resuming), not a saved "
                         f"model. The run's model is in {run}; to continue that training, pass "
                         f"--resume_from_checkpoint {name} with --output_dir {run}.")
    also = f" (or a GGUF checkpoint: a {GGUF_SUFFIX} file, or a folder holding one)" if takes_gguf else ""
    raise ValueError(f"{flag} {name} holds no config.json, so it is not a saved model folder; pass the folder "
                     f"save_pretrained wrote{also}.")


def _check_weights(folder: Path, flag: str) -> None:
    """The check `from_pretrained` of attnzoo's models makes on failure (`safetensors_problem`), made first."""
    from attnzoo.modeling.base_models import safetensors_problem

    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ValueError(f"{flag} {folder}: {weights.name} is damaged ({problem}): cut short or corrupted while "
                             "being written or copied. Copy or save it again.")


@contextmanager
def reading_model_source(name: str | Path, flag: str = "--model_name_or_path", takes_gguf: bool = False):
    """Around the first `from_pretrained(name)`: a local path is checked first (`check_model_source`; a caller that
    reads GGUF checkpoints itself, with `load_gguf_model`, says so with `takes_gguf`); a name that is no local folder
    and fails to load as a Hub id gets an error that names both readings."""
    check_model_source(name, flag, takes_gguf)
    try:
        yield
    except (OSError, ValueError) as error:
        if Path(name).exists():
            raise
        raise ValueError(f"{flag} {name}: there is no such local folder, and loading it as a Hub id failed "
                         f"({type(error).__name__}: {error}). Check the path (a run's --output_dir) or the Hub "
                         "id.") from error


def require_gguf_package(gguf: Path) -> None:
    """ModuleNotFoundError naming the install command when the `gguf` package, which transformers' GGUF loader
    reads the file with, is missing (transformers' own error names neither the file nor attnzoo's extra)."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading the GGUF checkpoint {gguf} needs the gguf package, an optional extra of "
                                  f"attnzoo: {GGUF_INSTALL}", name="gguf")


@contextmanager
def reading_gguf(gguf: Path, flag: str):
    """Around transformers' reading of a GGUF file: its ValueError for a file it cannot read (an architecture its
    GGUF loader does not know, a damaged file) names the argument."""
    require_gguf_package(gguf)
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{flag} {gguf}: transformers' GGUF loader cannot read this file ({error}). Convert a "
                         "checkpoint it reads: a folder with config.json, or a Hub id.") from error


def gguf_contents(gguf: Path) -> tuple[dict, list[str]]:
    """(metadata, tensor names) of a GGUF file, read with the gguf package: what a caller checks before trusting
    transformers' loader, which skips the keys and tensors it does not know. The tokenizer's arrays (vocabulary,
    merges, scores) are left out: they are large, and transformers builds the tokenizer from them."""
    require_gguf_package(gguf)
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(gguf)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if not (key.startswith("tokenizer.") and field.types[:1] == [GGUFValueType.ARRAY])}
    return metadata, [tensor.name for tensor in reader.tensors]


def load_gguf_config(gguf: Path, flag: str = "--model_name_or_path"):
    """The transformers config a GGUF file describes (read from its metadata by transformers)."""
    from transformers import AutoConfig

    with reading_gguf(gguf, flag):
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


#: the tokenizer's special tokens and the GGUF metadata (`tokenizer.ggml.*`) that states the id of each
GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                       "unk_token": "unknown_token_id"}


def load_gguf_tokenizer(gguf: Path, flag: str = "--model_name_or_path"):
    """The tokenizer transformers builds from a GGUF file's metadata (vocabulary, merges, chat template), with the
    special tokens the file states; `save_pretrained` writes it as an ordinary tokenizer folder."""
    from transformers import AutoTokenizer

    with reading_gguf(gguf, flag):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Some releases misread them (transformers 5.17 makes the end-of-text token the start token and drops the pad
    # token), which a saved tokenizer would keep: each is set from the id the file gives it.
    metadata, _ = gguf_contents(gguf)
    for role, key in GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and getattr(tokenizer, role) != tokenizer.convert_ids_to_tokens(token_id):
            setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def load_gguf_model(gguf: Path, model_class, flag: str = "--model_name_or_path", config=None, dtype="auto"):
    """`model_class` (a transformers model class) with the weights of a GGUF file, dequantised, as a plain model
    (no quantizer attached: it saves, trains and converts like any other). `config`: the file's
    (`load_gguf_config`), when read already.

    Returns (model, missing): the names of `model_class`'s weights the file did not provide (left at their random
    initialisation by `from_pretrained`, so the caller must refuse a non-empty list)."""
    import transformers

    require_gguf_package(gguf)
    config = config if config is not None else load_gguf_config(gguf, flag)
    # Dequantised explicitly: left to itself, transformers keeps the weights in their quantised blocks where a GGUF
    # matmul kernel is available (neither a converter nor the trainer can use those), and where none is it
    # dequantises but keeps the quantizer on the model, whose save_pretrained then refuses ("not serializable").
    dequantised = transformers.GgufConfig(dequantize=True)
    with reading_gguf(gguf, flag):
        model, info = model_class.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config, dtype=dtype,
                                                  quantization_config=dequantised, output_loading_info=True)
    return model, sorted(info["missing_keys"])
