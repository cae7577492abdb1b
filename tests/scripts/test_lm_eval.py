"""EleutherAI's lm-evaluation-harness on the zoo (docs/evaluation.md): lm-eval's own `hf` model scoring tiny
checkpoints of every family on attnzoo's local tasks (attnzoo/evaluation/tasks: held-out quick-start text as a
rolling-perplexity, a multiple-choice and a generate_until task), offline and on the CPU.

(a) a softmax conversion of a GPT-2 scores what the GPT-2 scores; (b) batches of 4 score what one-by-one does, every
family and a hybrid; (c) lm-eval's cached, left-padded generation equals greedy decoding by the full forward; (d) a
process that never imports attnzoo (the checkpoint's remote code) scores the same, through the Python API and the
`lm_eval` command; (e) scripts/evaluate.py runs tasks by name and writes the results into the model card."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

import attnzoo  # noqa: F401  (registers the families)
from attnzoo.evaluation.harness import INSTALL_HINT, LOCAL_TAG, LOCAL_TASKS, TASKS_DIR
from attnzoo.tokenization import byte_level_tokenizer
from tests.scripts_helpers import FAMILIES, QUIET, Started, english_text, run_script, tiny_model

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason=f"lm-eval is an optional extra: {INSTALL_HINT}")
slow = pytest.mark.slow

POSITIONS = 128  # shorter than some documents: rolling windows and left truncation of contexts take part
#: per family, attention settings small enough that 128 tokens use the efficient paths (chunks, hashing, proposals,
#: windows); a family not listed runs with its defaults
ATTENTION = {
    "softmax": {},
    "reformer": {"lsh_chunk_length": 8, "local_chunk_length": 8},
    "performer": {"num_random_features": 16, "linear_attention_chunk_size": 16},
    "ra": {},
    "lara": {"lara_num_samples": 4, "lara_chunk_size": 8},
    # windowed FAVOR+ (the plain one is the performer family's), LSH, local and softmax layers in one model
    "hybrid": {"attn_layers": ["favor_window", "lsh", "local", "full"], "num_hidden_layers": 4, "lsh_chunk_length": 8,
               "local_chunk_length": 8, "num_random_features": 16, "linear_attention_chunk_size": 16,
               "window_size": 16, "num_sink_tokens": 2},
    "window": {"window_size": 16, "num_sink_tokens": 2},
    # every attention with the exact window inside the layer, one per layer
    "windowed": {"attn_layers": ["favor_window", "lara_window", "ra_window", "lsh_window"], "num_hidden_layers": 4,
                 "num_random_features": 16, "lara_num_samples": 4, "lara_chunk_size": 8, "lsh_chunk_length": 8,
                 "window_size": 16, "num_sink_tokens": 2},
}
#: the model type of a test model that is no family of its own
MODEL_TYPES = {"windowed": "hybrid"}
MODELS = [*FAMILIES, "windowed"]
LIMIT = 6  # documents per task


@pytest.fixture(autouse=True)
def offline_on_one_thread(monkeypatch):
    """Nothing reaches the Hub or the web (lm-eval's task data are built locally). One CPU thread: the thousands of
    tiny forwards lm-eval makes here are no faster on more, and OpenMP threads waiting for a core that another
    process holds make them tens of times slower (tests/conftest.py restores the count)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family -> a saved tiny byte-level causal LM with its tokenizer, built once per module. The weights are drawn
    with standard deviation 0.3 instead of 0.02, so that the argmax and the scores depend on the context (a fresh
    model's greedy output repeats one byte whatever it reads, which would make comparisons of generations vacuous)."""
    built = {}

    def build(family: str) -> Path:
        if family not in built:
            tokenizer = byte_level_tokenizer(POSITIONS)
            values = dict(vocab_size=len(tokenizer), max_position_embeddings=POSITIONS, is_decoder=True,
                          hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          initializer_range=0.3, hidden_dropout_prob=0.0, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
            config = AutoConfig.for_model(f"attnzoo_{MODEL_TYPES.get(family, family)}",
                                          **{**values, **ATTENTION.get(family, {})})
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(f"lm_{family}")
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            built[family] = folder
        return built[family]

    return build


@pytest.fixture(scope="module")
def local_tasks():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(local_tasks, folder, batch_size: int, tasks=(LOCAL_TAG,), limit=LIMIT, **model_args) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model="hf", model_args={"pretrained": str(folder), **model_args}, tasks=list(tasks),
                           task_manager=local_tasks, batch_size=batch_size, limit=limit, device="cpu",
                           log_samples=True, bootstrap_iters=0)


def responses(results: dict) -> dict[str, list]:
    """task -> what the model answered for each document, in document order: [(log-likelihood, is-greedy)] per
    choice (multiple choice), [[log-likelihood]] (rolling), [[text]] (generation)."""
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def scores(results: dict) -> dict[str, float]:
    """"task/metric,filter" -> value, for every metric of every task."""
    return {f"{task}/{key}": float(value) for task, metrics in results["results"].items()
            for key, value in metrics.items() if "," in key and "_stderr," not in key}


def numbers_and_flags(document_responses: list) -> tuple[list[float], list[bool]]:
    """A document's log-likelihoods and is-greedy flags, whatever the request type (JSON makes tuples lists; the
    samples files of lm-eval's command write numbers and flags as strings)."""
    values, flags = [], []
    for request in document_responses:
        for answer in request:
            answer = answer if isinstance(answer, list | tuple) else [answer]
            values.append(float(answer[0]))
            flags += [flag in (True, "True") for flag in answer[1:]]
    return values, flags


def assert_same_responses(got: dict, expected: dict, rel: float) -> None:
    """Generated text and is-greedy flags exactly, log-likelihoods to `rel` (the float rounding of differently
    shaped batches)."""
    assert got.keys() == expected.keys() == set(LOCAL_TASKS)
    for task in LOCAL_TASKS:
        assert len(got[task]) == len(expected[task]) > 0
        for mine, theirs in zip(got[task], expected[task], strict=True):
            if task == "attnzoo_pydoc_next_word":
                assert mine == theirs, task
                continue
            (values, flags), (expected_values, expected_flags) = numbers_and_flags(mine), numbers_and_flags(theirs)
            assert flags == expected_flags and values == pytest.approx(expected_values, rel=rel), task


def task_documents():
    """The local tasks' document builders, loaded by path as lm-eval loads them."""
    spec = importlib.util.spec_from_file_location("pydoc_heldout", TASKS_DIR / "pydoc" / "pydoc_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the local tasks ---------------------------------------------------------------------------------------------
def test_local_tasks_are_built_from_the_held_out_quick_start_text():
    """The documents come from the bytes train_lm.py holds out of its default corpus (never trained on), and each
    task's answers are right by construction."""
    from attnzoo.training.text_data import read_bytes, split_bytes

    docs = task_documents()
    _, heldout = split_bytes(read_bytes(None), 0.05)  # train_lm.py's default corpus and --heldout_fraction
    assert docs.HELDOUT_FRACTION == 0.05
    heldout_text = bytes(heldout.numpy()).decode("utf-8", errors="ignore")
    assert docs.heldout_text() == heldout_text
    flat = " ".join(heldout_text.split())
    paragraphs = docs.paragraphs()
    assert len(paragraphs) >= 20 and all(p in flat for p in paragraphs)

    perplexity = docs.perplexity_documents()["test"]
    assert [d["text"] for d in perplexity] == paragraphs
    endings = docs.ending_documents()["test"]
    sentences = docs.sentences()
    assert len(endings) == len(sentences) >= 20
    for doc, sentence in zip(endings, sentences, strict=True):
        assert len(set(doc["endings"])) == 4 and f"{doc['context']} {doc['endings'][doc['label']]}" == sentence
    assert len({d["label"] for d in endings}) == 4  # the true ending is not always in the same place
    assert endings[:] == docs.ending_documents()["test"][:]  # the same task every time
    next_word = docs.next_word_documents()["test"]
    assert len(next_word) >= 20
    assert all(d["word"].isalpha() and f"{d['context']} " in flat and d["word"] in flat for d in next_word)


@needs_lm_eval
def test_lm_eval_finds_the_local_tasks(local_tasks):
    assert {LOCAL_TAG, *LOCAL_TASKS} <= set(local_tasks.all_tasks)
    loaded = local_tasks.load([LOCAL_TAG])["tasks"]
    assert {name: task.OUTPUT_TYPE for name, task in loaded.items()} == {
        "attnzoo_pydoc_perplexity": "loglikelihood_rolling", "attnzoo_pydoc_endings": "multiple_choice",
        "attnzoo_pydoc_next_word": "generate_until"}


# -- (a) a softmax conversion scores what its source scores ------------------------------------------------------
@needs_lm_eval
def test_softmax_conversion_of_gpt2_scores_what_gpt2_scores(tmp_path, local_tasks):
    """float64, batches of 4: per document the same log-likelihoods (to 1e-9), the same greedy flags, the same
    generations (left-padded batches: transformers' generate() numbers GPT-2's positions from the attention mask, as
    the zoo does), so the same metrics."""
    from attnzoo.convert import gpt2
    from attnzoo.convert.common import save_converted

    tokenizer = byte_level_tokenizer(POSITIONS)
    torch.manual_seed(0)
    source = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    source.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    save_converted(gpt2.convert(source, "softmax"), tmp_path / "softmax", [tokenizer])

    expected = evaluate(local_tasks, tmp_path / "gpt2", batch_size=4, dtype="float64")
    got = evaluate(local_tasks, tmp_path / "softmax", batch_size=4, dtype="float64")
    assert_same_responses(responses(got), responses(expected), rel=1e-9)
    assert scores(got) == pytest.approx(scores(expected), rel=1e-9)
    generated = [r[0][0] for r in responses(got)["attnzoo_pydoc_next_word"]]
    assert len(set(generated)) > 1, "the generations should depend on the context"


# -- (b) batches score what one-by-one does ----------------------------------------------------------------------
@needs_lm_eval
@pytest.mark.parametrize("family", MODELS)
def test_batched_scores_equal_one_by_one(family, checkpoint, local_tasks):
    """Batch size 4 (right-padded scoring batches, left-padded generation batches) against batch size 1: every
    family is deterministic in evaluation (eval_seed), and padding must not change a document's numbers."""
    folder = checkpoint(family)
    one_by_one = evaluate(local_tasks, folder, batch_size=1)
    batched = evaluate(local_tasks, folder, batch_size=4)
    assert_same_responses(responses(batched), responses(one_by_one), rel=1e-5)
    assert scores(batched) == pytest.approx(scores(one_by_one), rel=1e-5)
    rolling = responses(one_by_one)["attnzoo_pydoc_perplexity"]
    assert all(r[0][0] < 0 for r in rolling)


# -- (c) lm-eval's cached generation is greedy decoding ----------------------------------------------------------
def greedy_by_full_forward(model, tokenizer, context: str, max_gen_toks: int, until: list[str]) -> str:
    """What generate_until should return, computed without a cache or padding: the argmax of the full sequence's
    last logits, token by token, from the context as lm-eval truncates it (its last max_length - max_gen_toks
    tokens), up to the end-of-text token, then cut at the first stop sequence."""
    ids = tokenizer(context).input_ids[-(POSITIONS - max_gen_toks):]
    generated = []
    with torch.no_grad():
        for _ in range(max_gen_toks):
            token = int(model(torch.tensor([ids + generated])).logits[0, -1].argmax())
            generated.append(token)
            if token == tokenizer.eos_token_id:
                break
    text = tokenizer.decode(generated, skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


@needs_lm_eval
@pytest.mark.parametrize("family", MODELS)
def test_cached_generation_equals_greedy_full_forward(family, checkpoint, local_tasks):
    folder = checkpoint(family)
    results = evaluate(local_tasks, folder, batch_size=4, tasks=["attnzoo_pydoc_next_word"], limit=8)
    config = results["configs"]["attnzoo_pydoc_next_word"]["generation_kwargs"]
    samples = sorted(results["samples"]["attnzoo_pydoc_next_word"], key=lambda s: s["doc_id"])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    contexts = [s["arguments"][0][0] for s in samples]
    assert len({len(tokenizer(c).input_ids) for c in contexts}) > 1, "batches should need padding"
    expected = [greedy_by_full_forward(model, tokenizer, c, config["max_gen_toks"], config["until"])
                for c in contexts]
    assert [s["resps"][0][0] for s in samples] == expected
    assert len(set(expected)) > 1


# -- (d) without attnzoo: the checkpoint's own code --------------------------------------------------------------
FRESH_PROCESS = """
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
import torch
torch.set_num_threads(1)  # as the in-process run
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
tasks = TaskManager(include_path={tasks_dir!r}, include_defaults=False)
found = {{}}
for family, folder in {folders!r}.items():
    results = simple_evaluate(model="hf", model_args=f"pretrained={{folder}},trust_remote_code=True",
                              tasks=[{tag!r}], task_manager=tasks, batch_size=4, limit={limit}, device="cpu",
                              log_samples=True, bootstrap_iters=0)
    found[family] = {{task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
                     for task, samples in results["samples"].items()}}
code = sorted({{m.split(".")[-1] for m in sys.modules if m.startswith("transformers_modules")}})
imported = sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "attnzoo" and v is not None)
print(json.dumps({{"responses": found, "attnzoo_modules": imported, "remote_code": code}}))
"""


def start_without_attnzoo(script: str, tmp_path: Path) -> Started:
    """`script` in a fresh process, started in the background (the test computes what it expects meanwhile)."""
    return Started([sys.executable, "-c", script], cwd=tmp_path, env=fresh_env(tmp_path))


def printed_json(started: Started) -> dict:
    done = started.result(timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_env(tmp_path: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}


@needs_lm_eval
@pytest.mark.parametrize("families", [
    # windowed FAVOR+, LSH, local and softmax layers in one model; every windowed attention in another
    pytest.param(["hybrid", "windowed"], id="hybrid-and-windowed"),
    pytest.param([f for f in FAMILIES if f != "hybrid"], id="every-family", marks=slow)])
def test_a_process_without_attnzoo_scores_the_same(tmp_path, checkpoint, local_tasks, families):
    """lm-eval with trust_remote_code=True in a process where attnzoo cannot be imported (the checkpoint's own
    code runs) scores as the process with attnzoo does."""
    folders = {family: str(checkpoint(family)) for family in families}
    started = start_without_attnzoo(FRESH_PROCESS.format(tasks_dir=str(TASKS_DIR), folders=folders, tag=LOCAL_TAG,
                                                         limit=4), tmp_path)
    expected = {family: responses(evaluate(local_tasks, folders[family], batch_size=4, limit=4))
                for family in families}
    found = printed_json(started)
    assert found["attnzoo_modules"] == []
    assert "modeling_attnzoo" in found["remote_code"]
    for family in families:
        assert_same_responses(found["responses"][family], json.loads(json.dumps(expected[family])), rel=1e-6)


@needs_lm_eval
@slow
def test_lm_eval_command_without_attnzoo(tmp_path, checkpoint, local_tasks):
    """The documented command, `lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True`, with a
    stand-in `attnzoo` on the path that fails on import: the command never needs attnzoo, and scores as the API
    does in a process with attnzoo."""
    folder = checkpoint("hybrid")
    blocker = tmp_path / "no_attnzoo"
    blocker.mkdir()
    (blocker / "attnzoo.py").write_text("raise ImportError('imported attnzoo, which this process must not need')\n")
    beside_python = Path(sys.executable).parent / "lm_eval"
    executable = str(beside_python) if beside_python.is_file() else shutil.which("lm_eval")
    command = [executable, "--model", "hf", "--model_args",
               f"pretrained={folder},trust_remote_code=True", "--tasks", LOCAL_TAG, "--include_path", str(TASKS_DIR),
               "--batch_size", "2", "--limit", "4", "--device", "cpu", "--output_path", str(tmp_path / "out"),
               "--log_samples"]
    env = {**fresh_env(tmp_path), "PYTHONPATH": str(blocker)}
    started = Started(command, cwd=tmp_path, env=env)  # what the API gives is computed meanwhile
    expected = evaluate(local_tasks, folder, batch_size=2, limit=4)
    done = started.result(timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    found = json.loads(results_file.read_text())
    assert scores(found) == pytest.approx(scores(expected), rel=1e-6)
    written = {}
    for task in LOCAL_TASKS:
        [samples_file] = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
        written[task] = [sample["resps"] for sample in sorted(samples, key=lambda sample: sample["doc_id"])]
    assert_same_responses(written, json.loads(json.dumps(responses(expected))), rel=1e-6)


# -- (e) scripts/evaluate.py -------------------------------------------------------------------------------------
def trained_run(tmp_path: Path, family: str = "performer") -> Path:
    """A finished train_lm.py run: the model, its tokenizer and a model card carrying bits/dim."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:6_000])
    out = tmp_path / "run"
    # 128 positions: attnzoo_pydoc_endings scores endings of up to 96 bytes, which lm-eval refuses beyond the context
    run_script("train_lm", ["--train_file", corpus, "--block_size", "128", "--max_train_steps", "2",
                            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                            "--sample_tokens", "0", "--cpu_threads", "1", "--output_dir", out, *tiny_model(family),
                            *QUIET])
    return out


@needs_lm_eval
def test_evaluate_script_writes_lm_eval_results_into_the_model_card(tmp_path):
    from huggingface_hub import ModelCard

    out = trained_run(tmp_path)
    before = ModelCard.load(out / "README.md").data.eval_results
    assert [r.metric_type for r in before] == ["bits_per_dim"]

    found = run_script("evaluate", ["--model_name_or_path", out, "--lm_eval_tasks", LOCAL_TAG,
                                    "--lm_eval_limit", "4", "--per_device_eval_batch_size", "2",
                                    "--output_file", tmp_path / "lm_eval.json"])
    rows = {(r["task"], r["metric"]): r for r in found["lm_eval"]}
    assert set(rows) == {("attnzoo_pydoc_perplexity", m) for m in ("word_perplexity", "byte_perplexity",
                                                                    "bits_per_byte")} | {
        ("attnzoo_pydoc_endings", "acc"), ("attnzoo_pydoc_endings", "acc_norm"),
        ("attnzoo_pydoc_next_word", "exact_match")}
    assert all(r["samples"] == 4 for r in rows.values())
    assert 0 <= rows["attnzoo_pydoc_endings", "acc"]["value"] <= 1
    assert json.loads((tmp_path / "lm_eval.json").read_text())["lm_eval"] == json.loads(json.dumps(found["lm_eval"]))

    card = ModelCard.load(out / "README.md")
    results = {(r.dataset_name, r.metric_type): r for r in card.data.eval_results}
    assert results["corpus.txt", "bits_per_dim"].metric_value == before[0].metric_value  # training's, kept
    for (task, metric), row in rows.items():
        result = results[task, metric]
        assert result.metric_value == round(row["value"], 4) and result.source_name == "lm-evaluation-harness"
        assert result.metric_config.startswith("lm-eval 0.") and "4 of " in result.metric_config
    assert "| attnzoo_pydoc_endings | acc |" in card.text and "## How to use" in card.text
    assert card.text.index("## lm-evaluation-harness") < card.text.index("## How to use")

    # A second evaluation replaces what it measures again and keeps the rest (one table, one entry per metric).
    run_script("evaluate", ["--model_name_or_path", out, "--lm_eval_tasks", "attnzoo_pydoc_endings",
                            "--lm_eval_limit", "6", "--per_device_eval_batch_size", "2"])
    card = ModelCard.load(out / "README.md")
    keys = [(r.dataset_name, r.metric_type) for r in card.data.eval_results]
    assert len(keys) == len(set(keys)) == 1 + len(rows)
    assert "6 of " in next(r for r in card.data.eval_results if r.metric_type == "acc").metric_config
    assert card.text.count("## lm-evaluation-harness") == 1
    assert "| attnzoo_pydoc_perplexity | bits_per_byte |" in card.text


@needs_lm_eval
def test_evaluate_script_takes_task_folders_and_writes_a_card_where_there_was_none(tmp_path, checkpoint):
    """--include_path adds a task folder (here a copy of one task under another name, by YAML file); a model
    folder without README.md gets a card holding just the results; --model_card names another file."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoint("softmax"), folder)
    assert not (folder / "README.md").exists()
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    yaml = (TASKS_DIR / "pydoc" / "attnzoo_pydoc_endings.yaml").read_text()
    (tasks / "my_endings.yaml").write_text(yaml.replace("task: attnzoo_pydoc_endings", "task: my_endings")
                                           .replace("tag: attnzoo_pydoc\n", ""))
    shutil.copy(TASKS_DIR / "pydoc" / "pydoc_heldout.py", tasks)  # `!function` looks beside the YAML file
    found = run_script("evaluate", ["--model_name_or_path", folder, "--lm_eval_tasks", "my_endings",
                                    "--include_path", tasks, "--lm_eval_limit", "3"])
    assert {(r["task"], r["metric"]) for r in found["lm_eval"]} == {("my_endings", "acc"), ("my_endings", "acc_norm")}
    card = (folder / "README.md").read_text()
    assert "model-index" in card and "| my_endings | acc |" in card

    elsewhere = tmp_path / "card.md"
    run_script("evaluate", ["--model_name_or_path", folder, "--lm_eval_tasks", "my_endings", "--include_path",
                            tasks, "--lm_eval_limit", "3", "--model_card", elsewhere])
    assert "| my_endings | acc |" in elsewhere.read_text()


@needs_lm_eval
def test_evaluate_script_refuses_bad_lm_eval_arguments(tmp_path, checkpoint):
    folder = checkpoint("softmax")
    base = ["--model_name_or_path", folder, "--model_card", "none"]
    with pytest.raises(ValueError, match="--lm_eval_tasks.*attnzoo_pydoc_ending"):
        run_script("evaluate", [*base, "--lm_eval_tasks", "attnzoo_pydoc_ending"])
    with pytest.raises(ValueError, match="--include_path"):
        run_script("evaluate", [*base, "--lm_eval_tasks", LOCAL_TAG, "--include_path", tmp_path / "missing"])
    with pytest.raises(ValueError, match="--lm_eval_limit"):
        run_script("evaluate", [*base, "--lm_eval_tasks", LOCAL_TAG, "--lm_eval_limit", "0"])
    with pytest.raises(ValueError, match="data arguments"):
        run_script("evaluate", [*base, "--lm_eval_tasks", LOCAL_TAG, "--corpus", "enwik8"])
    with pytest.raises(ValueError, match=r"--lm_eval_metadata '\[1024\]' is a JSON list; pass an object"):
        run_script("evaluate", [*base, "--lm_eval_tasks", "attnzoo_passkey", "--lm_eval_metadata", "[1024]"])
    with pytest.raises(ValueError, match=r"--lm_eval_metadata .* is not JSON"):
        run_script("evaluate", [*base, "--lm_eval_tasks", "attnzoo_passkey", "--lm_eval_metadata", "{lengths"])
    with pytest.raises(ValueError, match=r"--num_fewshot.*add --lm_eval_tasks"):
        run_script("evaluate", ["--model_name_or_path", folder, "--num_fewshot", "5"])
    untokenized = tmp_path / "no_tokenizer"
    shutil.copytree(folder, untokenized, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match="holds no tokenizer.*tokenizer="):
        run_script("evaluate", ["--model_name_or_path", untokenized, "--lm_eval_tasks", LOCAL_TAG])


@needs_lm_eval
@pytest.mark.parametrize("choice, says", [(dict(limit=3, samples={LOCAL_TAG: [0]}), "give one of them"),
                                          (dict(samples={"other_task": [0]}), "for tasks among"),
                                          (dict(samples={LOCAL_TAG: []}), "non-empty list")])
def test_the_harness_refuses_documents_chosen_twice_or_for_no_task(tmp_path, choice, says):
    from attnzoo.evaluation import harness

    with pytest.raises(ValueError, match=says):
        harness.run(tmp_path, [LOCAL_TAG], **choice)


def test_without_lm_eval_the_script_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'attnzoo\[lm-eval\]'"):
        run_script("evaluate", ["--model_name_or_path", tmp_path, "--lm_eval_tasks", LOCAL_TAG])
