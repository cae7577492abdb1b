"""Run EleutherAI's lm-evaluation-harness on a checkpoint of the zoo, and flatten what it reports into one row per
(task, metric, filter) for the model card and JSON.

lm-eval is an optional extra (`pip install 'attnzoo[lm-eval]'`); this module imports it only when called, so attnzoo
works without it. The model is lm-eval's own `hf` model (`HFLM`), loading the checkpoint by its path or Hub id as
`lm_eval --model hf --model_args pretrained=...` does, so the numbers are the ones anyone gets from the command line.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import math
from pathlib import Path

#: the task folder that ships with attnzoo (always searched, before any --include_path)
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
#: the tasks in it (a tag of the same name runs all three)
LOCAL_TASKS = ("attnzoo_pydoc_perplexity", "attnzoo_pydoc_endings", "attnzoo_pydoc_next_word")
#: the pass-key tasks in it, sized by `metadata` (lengths in the model's tokens; tasks/passkey/passkey_tasks.py)
PASSKEY_TASKS = ("attnzoo_passkey", "attnzoo_passkey_distance")
LOCAL_TAG = "attnzoo_pydoc"
#: the oldest lm-eval the tests ran with (pyproject's `lm-eval` extra has the same lower bound)
MIN_LM_EVAL_VERSION = (0, 4, 13)
INSTALL_HINT = "pip install 'attnzoo[lm-eval]'"
#: lm-eval's RULER tasks whose haystacks are built without nltk's sentence splitter: repeated sentences (haystack
#: "repeat") or generated needle lines ("needle"). The others split Paul Graham's essays (a Hub data set) into
#: sentences with nltk's Punkt model.
RULER_TASKS_WITHOUT_SENTENCES = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
RULER_INSTALL_HINT = "pip install 'attnzoo[ruler]'"


def lm_eval_version() -> str:
    """The installed lm-eval's version; an error naming the extra when it is missing or older than the tested one."""
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "lm_eval":  # lm-eval is there but one of its own imports is not: say which
            raise
        raise ModuleNotFoundError(f"lm-evaluation-harness (the lm_eval package) is not installed; it is an optional "
                                  f"extra of attnzoo: {INSTALL_HINT}", name="lm_eval") from error
    version = importlib.metadata.version("lm_eval")
    numbers = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    if numbers < MIN_LM_EVAL_VERSION:
        raise ImportError(f"lm_eval {version} is older than {'.'.join(map(str, MIN_LM_EVAL_VERSION))}, the oldest "
                          f"attnzoo is tested with: {INSTALL_HINT} --upgrade")
    return version


def prepare_ruler_offline(tasks: list[str], data_dir: str | Path | None) -> str | None:
    """Let lm-eval's RULER tasks `tasks` run without the network; returns where nltk's `punkt_tab` is found (None
    when `data_dir` is None and it would have to be written: a check that writes nothing).

    lm-eval's RULER module (lm_eval/tasks/ruler/prepare_niah.py) looks for nltk's `punkt_tab` when it is imported
    and downloads it when it is missing, and it draws its keys with the `wonderwords` package. When `punkt_tab` is
    not installed and every task is one of `RULER_TASKS_WITHOUT_SENTENCES`, an empty Punkt model is written into
    `data_dir`/tokenizers/punkt_tab/english and put on nltk's search path: those tasks never call the splitter, so
    their samples are the ones lm-eval builds with the real model. Raises ModuleNotFoundError naming the extra when
    wonderwords or nltk is missing, and ValueError naming the fix for a task that splits sentences."""
    lm_eval_version()
    try:
        import nltk
        import wonderwords  # noqa: F401
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"lm-eval's RULER tasks need the {error.name} package: {RULER_INSTALL_HINT}",
                                  name=error.name) from error
    try:
        return str(nltk.data.find("tokenizers/punkt_tab"))
    except LookupError:
        pass
    splitting = [task for task in tasks if task not in RULER_TASKS_WITHOUT_SENTENCES]
    if splitting:
        raise ValueError(f"RULER tasks {splitting} split their haystack into sentences with nltk's punkt_tab, which "
                         "is not installed: run `python -m nltk.downloader punkt_tab` where there is a network, or "
                         f"pick from {list(RULER_TASKS_WITHOUT_SENTENCES)}, which build their haystacks without it.")
    if data_dir is None:
        return None
    english = Path(data_dir) / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (english / name).touch()  # an empty model: no abbreviations, collocations or sentence starters
    if str(data_dir) not in nltk.data.path:
        nltk.data.path.append(str(data_dir))
    return str(nltk.data.find("tokenizers/punkt_tab"))


def task_manager(tasks: list[str], include_path: list[str | Path] = (), metadata: dict | None = None):
    """An lm-eval `TaskManager` that finds attnzoo's task folder, the `include_path` folders and, only when some
    task is not among those, lm-eval's own tasks (indexing its ~15,000 YAML files takes seconds). Unknown names
    raise ValueError with the nearest known ones."""
    from lm_eval.tasks import TaskManager

    folders = [TASKS_DIR, *(Path(p) for p in include_path)]
    missing = [str(p) for p in folders if not Path(p).is_dir()]
    if missing:
        raise ValueError(f"--include_path {missing}: no such folder; pass folders that hold lm-eval task YAML files.")
    local = TaskManager(include_path=[str(p) for p in folders], include_defaults=False, metadata=metadata)
    if all(_known(local, name) for name in tasks):
        return local
    manager = TaskManager(include_path=[str(p) for p in folders], metadata=metadata)
    unknown = [name for name in tasks if not _known(manager, name)]
    if unknown:
        hints = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        raise ValueError(f"--lm_eval_tasks {unknown}: not lm-eval task, group or tag names (nearest: {hints}) nor YAML "
                         "files; `lm_eval ls tasks` lists them, and --include_path adds task folders.")
    return manager


def _known(manager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def run(model_name_or_path: str | Path, tasks: list[str], *, include_path: list[str | Path] = (), batch_size=1,
        num_fewshot: int | None = None, limit: float | None = None, samples: dict[str, list[int]] | None = None,
        device: str = "cpu", model_args: dict | None = None, log_samples: bool = False,
        bootstrap_iters: int = 100_000, metadata: dict | None = None) -> dict | None:
    """lm-eval's results dict for `tasks` (names, tags, groups or YAML files), or None on the processes other than
    the main one under `accelerate launch` (lm-eval splits the requests across them). `model_args` go to lm-eval's
    `hf` model as `--model_args` do (e.g. trust_remote_code, dtype, mixed_precision_dtype, max_length);
    `metadata` to the tasks as `--metadata` does (e.g. the pass-key tasks' `max_seq_lengths`), with the model's
    arguments, as lm-eval's command gives them. `samples` ({task: document indices}, as `--samples` does) runs
    those documents only, instead of the first `limit`, so that a long evaluation can go in parts."""
    lm_eval_version()
    from lm_eval import simple_evaluate

    if not tasks:
        raise ValueError("--lm_eval_tasks is empty: name at least one task, e.g. attnzoo_pydoc.")
    if limit is not None and not limit > 0:
        raise ValueError(f"--lm_eval_limit={limit} must be positive (a count of documents, or a fraction below 1).")
    if limit is not None and samples is not None:
        raise ValueError("limit and samples both choose the documents: give one of them.")
    if samples is not None and (set(samples) - set(tasks) or any(not ids for ids in samples.values())):
        raise ValueError(f"samples={samples!r}: give a non-empty list of document indices for tasks among {tasks}.")
    if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch size {batch_size!r} must be a positive integer or 'auto'.")
    model_args = {"pretrained": str(model_name_or_path), **(model_args or {})}
    manager = task_manager(list(tasks), list(include_path), {**model_args, **(metadata or {})})
    return simple_evaluate(model="hf", model_args=model_args,
                           tasks=list(tasks), task_manager=manager, batch_size=batch_size, num_fewshot=num_fewshot,
                           limit=limit, samples=samples, device=device, log_samples=log_samples,
                           bootstrap_iters=bootstrap_iters)


def _number(value) -> float | None:
    """A metric value as a float; lm-eval writes "N/A" for a standard error it did not compute."""
    if isinstance(value, str):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def summarize(results: dict) -> list[dict]:
    """One row per (task, metric, filter) of lm-eval's results: value, standard error (None where lm-eval computed
    none), the number of documents scored and of the task, the few-shot count, the task's version and data set."""
    rows = []
    for task, metrics in results["results"].items():
        config = results.get("configs", {}).get(task, {})
        counts = results.get("n-samples", {}).get(task, {})
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue  # name, alias, sample_len; standard errors go with their metric
            metric, filter_name = key.split(",", 1)
            if _number(value) is None:
                continue
            rows.append({
                "task": task, "metric": metric, "filter": filter_name, "value": _number(value),
                "stderr": _number(metrics.get(f"{metric}_stderr,{filter_name}", "N/A")),
                "num_fewshot": results.get("n-shot", {}).get(task), "samples": counts.get("effective"),
                "task_samples": counts.get("original"), "version": results.get("versions", {}).get(task),
                "dataset": config.get("dataset_path") or task,
                "split": config.get("test_split") or config.get("validation_split"),
            })
    return rows
