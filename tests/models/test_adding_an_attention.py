"""docs/adding_an_attention.md, done as the page says: its three code blocks, run as written (a module of the
user's own, a script that trains a step and saves, a script that loads where attnzoo is not importable and
generates), and what `save_pretrained` refuses. Also: every family's checkpoint code obeys the import rule."""

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.remote_code import family_model_classes, remote_code_files, unguarded_imports
from tests.scripts_helpers import Started

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_an_attention.md"
ROOT = Path(__file__).resolve().parents[2]


def doc_blocks() -> dict[str, str]:
    """file name (the block's first-line comment) -> code, for the page's python blocks."""
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {name: f"# {name}\n{code}" for name, code in blocks}


def save_attempt(attention: str) -> str:
    """Script lines: build a one-layer model with `attention` and try to save it into out/."""
    return f"""
from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM
model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(attn_layers=[{attention!r}], vocab_size=20, hidden_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
try:
    model.save_pretrained("out")
except ValueError as error:
    print("REFUSED", error)
"""


def start(code: str, cwd: Path, block_attnzoo: bool = False) -> Started:
    """`code` in a fresh Python process, started in the background (`finished` waits for its output)."""
    prefix = "import sys; sys.modules['attnzoo'] = None  # as if attnzoo were not installed\n" if block_attnzoo else ""
    env_path = "" if block_attnzoo else str(ROOT)
    return Started([sys.executable, "-c", prefix + code], cwd=cwd,
                   env={**__import__("os").environ, "PYTHONPATH": env_path})


def finished(started: Started) -> str:
    done = started.result(timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run(code: str, cwd: Path, block_attnzoo: bool = False) -> str:
    return finished(start(code, cwd, block_attnzoo))


@pytest.mark.slow
def test_the_page_runs_as_written_and_the_checkpoint_loads_without_attnzoo(tmp_path):
    blocks = doc_blocks()
    assert list(blocks) == ["temperature_attention.py", "train_and_save.py", "load_and_generate.py",
                            "elu_far_part.py"]  # the last one: tests/models/test_adding_a_far_part.py
    for name, code in blocks.items():
        (tmp_path / name).write_text(code, encoding="utf-8")
    run(blocks["train_and_save.py"], tmp_path)
    saved = tmp_path / "my-model"
    assert (saved / "user_temperature_attention.py").is_file()
    # the saved model's outputs, computed where attnzoo and the user's module are importable (`folder`: the user's)
    compare = """
import json, sys, torch
sys.path.insert(0, {folder!r})
{imports}
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({model!r}{remote}).eval()
ids = torch.arange(1, 13)[None] % 64
with torch.no_grad():
    logits = model(ids).logits
cached = model.generate(ids, max_new_tokens=6, do_sample=False)
uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
print(json.dumps({{"module": type(model.model.transformer.blocks[0].attn).__module__,
                  "logits": logits.flatten().tolist(), "cached": cached.tolist(), "uncached": uncached.tolist()}}))
"""
    local = start(compare.format(folder=str(tmp_path), imports="import attnzoo, temperature_attention",
                                 model=str(saved), remote=""), tmp_path)
    # meanwhile, on the colleague's machine, which has neither attnzoo nor the file: a folder holding only the model
    colleague = tmp_path / "colleague"
    shutil.copytree(saved, colleague / "my-model")
    remote = json.loads(run(compare.format(folder=str(colleague), imports="", model=str(colleague / "my-model"),
                                           remote=", trust_remote_code=True"), colleague,
                            block_attnzoo=True).splitlines()[-1])
    out = run(blocks["load_and_generate.py"], colleague, block_attnzoo=True)
    local = json.loads(finished(local).splitlines()[-1])
    assert local["module"] == "temperature_attention" and remote["module"].startswith("transformers_modules")
    assert remote["logits"] == local["logits"]
    assert remote["cached"] == remote["uncached"] == local["cached"]
    assert out.startswith("[1, 2, 3, ") and len(json.loads(out)) == 11


#: module -> (the line put after its first line, what the refusal must say)
CANNOT_TRAVEL = {
    "bad_attention": ("import numpy", r"imports numpy \(line 2\), which a checkpoint's code cannot carry"),
    "userpkg.bad_attention": ("from .helpers import x", r"relative import \(line 2\)"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """The refusal tests' scripts (each registers an attention of the user's and tries to save a model with it),
    all started at once when the first of those tests asks: each is a fresh Python process importing attnzoo, some
    ten seconds on two cores, so they run side by side rather than one after the other. case (a module of
    CANNOT_TRAVEL, or "__main__") -> (the script's folder, its process)."""
    started = {}
    for module, (first_line, _) in CANNOT_TRAVEL.items():
        tmp_path = tmp_path_factory.mktemp("cannot_travel")
        folder = tmp_path / "userpkg" if module.startswith("userpkg.") else tmp_path
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").touch()
        (folder / "helpers.py").write_text("x = 1\n")
        code = doc_blocks()["temperature_attention.py"].replace('"temperature_softmax"', '"bad_softmax"')
        (folder / "bad_attention.py").write_text(code.replace("\n", f"\n{first_line}\n", 1), encoding="utf-8")
        imports = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport attnzoo, {module}\n"
        started[module] = (tmp_path, start(imports + save_attempt("bad_softmax"), tmp_path))
    tmp_path = tmp_path_factory.mktemp("defined_in_main")
    started["__main__"] = (tmp_path, start(doc_blocks()["temperature_attention.py"] +
                                           save_attempt("temperature_softmax"), tmp_path))
    yield started
    for _, process in started.values():
        process.stop()


@pytest.mark.parametrize("module, message", [(module, message) for module, (_, message) in CANNOT_TRAVEL.items()])
def test_an_attention_module_that_cannot_travel_is_refused_before_anything_is_written(refusals, module, message):
    tmp_path, process = refusals[module]
    out = finished(process)
    assert out.startswith("REFUSED") and re.search(message, out), out
    assert not (tmp_path / "out").exists()


def test_an_attention_defined_in_main_is_refused_with_what_to_do(refusals):
    tmp_path, process = refusals["__main__"]
    out = finished(process)
    assert "REFUSED" in out and "defined in __main__" in out and "move the class into a module file" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_familys_checkpoint_code_imports_only_what_travels(family):
    config_class = FAMILY_CONFIGS[family]
    prefix = config_class.__name__.removesuffix("Config")
    causal_lm = getattr(__import__("attnzoo"), prefix + "ForCausalLM")
    torch.manual_seed(0)
    model = causal_lm(config_class(vocab_size=20, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=64))
    attentions = list(dict.fromkeys(type(m.attn) for m in model.model.transformer.blocks))
    files = remote_code_files(config_class, family_model_classes(causal_lm), attentions)
    for name, source in files.items():
        for node in unguarded_imports(ast.parse(source)):  # imports inside `try` are optional (Triton)
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert node.module in files, f"{name}.py imports .{node.module}, which the checkpoint lacks"
            else:
                roots = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                    [(node.module or "").split(".")[0]]
                for root in roots:
                    assert root in ("__future__", "torch", "transformers") or root in sys.stdlib_module_names, \
                        f"{name}.py imports {root}"
