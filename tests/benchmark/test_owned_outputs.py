"""benchmarks/owned_outputs.py, the output-folder rule of the benchmarks, through benchmarks/long_context.py (issue
45): a user's train_lm.py run, their lm-eval scores and their own JSON are refused, not replaced; the committed report
is replaced only by a report of its own setup (another setup's goes beside it) and only it rewrites the tables;
`--readme_only` names the file and what is wrong with it. Every refusal leaves every file byte for byte. Training and
evaluation are stubbed: these are seconds-long checks of what is written where."""

from __future__ import annotations

import hashlib
import importlib
import json
import runpy
import shutil
import sys

import pytest

from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "long_context")
owned = importlib.import_module("owned_outputs")  # the module long_context.py imported (benchmarks/ is on the path)
COMMITTED = ROOT / "benchmarks" / "results" / "long_context.json"
TINY = ["--models", "source", "--steps", "1", "--batch", "2", "--block_size", "32", "--hidden", "16", "--layers", "1",
        "--heads", "1", "--length_multiples", "1", "2", "--passkey_depths", "0.5", "--passkey_trials", "1",
        "--heldout_sequences", "1", "--lm_eval_limit", "2", "--scan_lengths"]


def tree(folder) -> dict:
    """Every file and folder under `folder` with its bytes' digest: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def users_train_lm_run(folder):
    """A run of scripts/train_lm.py the way a user leaves one: its record, its model, its log."""
    folder.mkdir(parents=True)
    (folder / "run_args.json").write_text(json.dumps({"script": "train_lm", "model_type": "attnzoo_softmax",
                                                      "family": "softmax", "outputs": ["all_results.json",
                                                                                       "config.json", "metrics.jsonl",
                                                                                       "model.safetensors",
                                                                                       "run_args.json"]}))
    (folder / "config.json").write_text('{"model_type": "attnzoo_softmax"}')
    (folder / "model.safetensors").write_bytes(b"the user's weights")
    (folder / "all_results.json").write_text('{"train_steps": 3000, "train_seconds": 3600.0}')
    (folder / "metrics.jsonl").write_text('{"step": 100, "train_loss": 1.2}\n')


@pytest.fixture
def no_subprocess(monkeypatch):
    """Fails a test that would start a training, conversion or evaluation (a refusal comes before any)."""
    calls = []

    def run(command, log, execute=True):
        calls.append(command)
        if execute:
            raise AssertionError(f"the benchmark ran {command} before refusing")

    monkeypatch.setattr(bench, "run", run)
    return calls


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    """The benchmark with tiny fakes for training, evaluation and the plot, and its tables in temporary pages."""
    pages = []
    for name in ("README.md", "long_context.md"):
        page = tmp_path / "pages" / name
        page.parent.mkdir(exist_ok=True)
        page.write_text(f"before\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
        pages.append(page)
    monkeypatch.setattr(bench, "TABLE_FILES", tuple(pages))

    def train(name, args, runs, log):
        runs.path(name)  # the real one claims its folder first
        log.append(f"scripts/train_lm.py --output_dir {args.output_dir / name}")
        return {"folder": str(args.output_dir / name), "family": bench.DESIGNS[name][0],
                "answer_weight": args.passkey_answer_weight, "train_steps": args.steps, "train_loss_by_step": []}

    def evaluate(name, folder, args, runs, log, rope_scaling=None):
        lengths = [str(args.block_size * m) for m in args.length_multiples]
        edges = [0, *args.length_multiples]
        buckets = {f"{a}-{b}x": 1.5 for a, b in zip(edges, edges[1:], strict=False)}
        positions = {f"{m}x": buckets for m in args.length_multiples} if rope_scaling else buckets
        return {"passkey": dict.fromkeys(lengths, 1.0), "cells": [], "bits_per_dim_by_position": positions,
                "state_bytes": None if rope_scaling else dict.fromkeys(lengths, 100), "lm_eval": None,
                "steps_seen": args.steps}

    monkeypatch.setattr(bench, "train_design", train)
    monkeypatch.setattr(bench, "evaluate_design", evaluate)
    monkeypatch.setattr(bench, "plot", lambda report, path: path.write_bytes(b"a plot of " + path.name.encode()))
    return pages


# -- runs -------------------------------------------------------------------------------------------------------
def test_a_users_train_lm_run_and_lm_eval_scores_are_refused_not_retrained(tmp_path, no_subprocess):
    """Issue 45: --output_dir X with the user's X/source (train_lm.py) and X/lm_eval/source emptied, retrained and
    deleted; now refused before anything is written, naming the folder and the fix."""
    out = tmp_path / "mine"
    users_train_lm_run(out / "source")
    (out / "lm_eval" / "source").mkdir(parents=True)
    (out / "lm_eval" / "source" / "lm_eval.json").write_text('{"script": "evaluate", "lm_eval": []}')
    before = tree(tmp_path)
    with pytest.raises(owned.Refused) as refused:
        bench.main([*TINY, "--output_dir", str(out), "--results", str(tmp_path / "lc.json")])
    message = str(refused.value)
    assert f"--output_dir {out} holds" in message and "not the runs of benchmarks/long_context.py" in message
    assert "pick another --output_dir" in message and "Nothing was written" in message
    assert tree(tmp_path) == before and no_subprocess == []


def test_a_folder_holding_a_users_run_itself_is_refused(tmp_path):
    users_train_lm_run(tmp_path / "run")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"holds a run of train_lm\.py \(family softmax"):
        owned.OutputFolder(tmp_path / "run", bench.SCRIPT)
    assert tree(tmp_path) == before


def test_a_users_folder_inside_the_benchmarks_own_is_refused(tmp_path):
    """A benchmark folder of its own, into which a user copied a run and lm-eval scores: those are not its runs."""
    runs = owned.OutputFolder(tmp_path / "runs", bench.SCRIPT)
    runs.write_record("window", "command", ["scripts/train_lm.py"])  # the benchmark's first write records it
    users_train_lm_run(tmp_path / "runs" / "source")
    (tmp_path / "runs" / "lm_eval" / "other").mkdir(parents=True)
    (tmp_path / "runs" / "lm_eval" / "other" / "scores.json").write_text("{}")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"runs/source holds a run of train_lm\.py .* did not record writing"):
        runs.start_or_resume("source", ["scripts/train_lm.py"])
    # the folder above a new one counts too: a user's lm_eval/ is not the benchmark's to add to
    with pytest.raises(owned.Refused, match=r"runs/lm_eval holds .*did not record writing.*pick another"):
        runs.path("lm_eval/source")
    assert tree(tmp_path) == before
    assert runs.owns("window") is False and runs.owns("records")  # only what it wrote is its own


def test_a_run_of_its_own_is_cleared_by_its_record_and_a_foreign_file_in_it_refuses(tmp_path):
    runs = owned.OutputFolder(tmp_path / "runs", bench.SCRIPT)
    assert runs.start_or_resume("window", ["a"]) == []
    users_train_lm_run(tmp_path / "runs" / "window")  # the run the benchmark started: train_lm.py's record
    (tmp_path / "runs" / "window" / "notes.txt").write_text("the user's notes")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"runs/window must be redone, but it also holds files its run did not "
                                            r"write \(notes\.txt\); nothing was deleted"):
        runs.start_or_resume("window", ["b"])
    assert tree(tmp_path) == before
    (tmp_path / "runs" / "window" / "notes.txt").unlink()
    assert runs.start_or_resume("window", ["b"]) == [] and not (tmp_path / "runs" / "window").exists()


def test_a_folder_of_the_benchmarks_earlier_versions_is_adopted_and_nothing_else(tmp_path):
    root = tmp_path / "runs"
    for name in ("window_command.json", "window_evaluation.json", "source_started.json"):
        (root / "records").mkdir(parents=True, exist_ok=True)
        (root / "records" / name).write_text("[]")
    users_train_lm_run(root / "window")
    (root / "lm_eval" / "window").mkdir(parents=True)
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("not the benchmark's")
    runs = owned.OutputFolder(root, bench.SCRIPT, legacy=owned.legacy_records_layout)
    assert runs.owns("window") and runs.owns("lm_eval/window") and runs.owns("records") and not runs.owns("mine")
    assert runs.read_record("window", "command") == []
    with pytest.raises(owned.Refused, match="runs/mine holds"):
        runs.path("mine")
    runs.write_record("source", "command", ["x"])  # the first write records what was adopted
    record = json.loads((root / "run_args.json").read_text())
    assert {"window", "lm_eval/window", "records"} <= set(record["outputs"]) and "mine" not in record["outputs"]
    # a folder with other records is not such a folder
    (tmp_path / "other" / "records").mkdir(parents=True)
    (tmp_path / "other" / "records" / "mine.json").write_text("{}")
    with pytest.raises(owned.Refused, match="not the runs of"):
        owned.OutputFolder(tmp_path / "other", bench.SCRIPT, legacy=owned.legacy_records_layout)


def test_reusing_every_figure_creates_no_folder(tmp_path, stubbed):
    flags = [*TINY, "--output_dir", str(tmp_path / "runs"), "--results", str(tmp_path / "lc.json")]
    bench.main(flags)
    shutil.rmtree(tmp_path / "runs")  # a fresh checkout: the report, no runs
    bench.main(flags)
    assert not (tmp_path / "runs").exists()


# -- results files ---------------------------------------------------------------------------------------------
def test_a_users_own_json_is_refused(tmp_path, stubbed, no_subprocess):
    """Issue 45: --results mine.json pointing at a user's own JSON replaced it and drew mine.png."""
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "scores"}')
    before = tree(tmp_path)
    with pytest.raises(owned.Refused) as refused:
        bench.main([*TINY, "--output_dir", str(tmp_path / "runs"), "--results", str(mine)])
    assert str(refused.value) == (f"--results {mine} is not a report of benchmarks/long_context.py: it has no 'setup' "
                                  "(a report has 'setup', 'designs', 'models' and 'commands'). It is left as it is "
                                  "and nothing was written: name another --results (or move that file away).")
    assert tree(tmp_path) == before
    # a picture with no report of the benchmark's beside it is not drawn over either
    mine.unlink()
    (tmp_path / "mine.png").write_bytes(b"the user's picture")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"mine\.png exists with no report of benchmarks/long_context\.py at "):
        bench.main([*TINY, "--output_dir", str(tmp_path / "runs"), "--results", str(mine)])
    assert tree(tmp_path) == before


def test_the_committed_report_is_replaced_only_by_its_own_setup_and_only_it_writes_the_tables(
        tmp_path, stubbed, monkeypatch):
    """Issue 45: a one-step run with the default --results overwrote the committed 31-model report, its plot and the
    tables. Here on a copy: another setup's report goes beside it, and the tables stay."""
    if not COMMITTED.is_file():
        pytest.skip("no committed report")
    committed = tmp_path / "results" / "long_context.json"
    committed.parent.mkdir()
    shutil.copy(COMMITTED, committed)
    shutil.copy(COMMITTED.with_suffix(".png"), committed.with_suffix(".png"))
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", committed)
    pages = {page: page.read_bytes() for page in stubbed}
    before = tree(committed.parent)
    flags = [*TINY, "--output_dir", str(tmp_path / "runs"), "--results", str(committed)]
    report = bench.main(flags)
    assert tree(committed.parent).items() >= before.items()  # the committed report and plot, byte for byte
    assert {page: page.read_bytes() for page in stubbed} == pages  # and the tables
    beside = committed.with_name(f"long_context-{owned.setup_digest(report['setup'])}.json")
    assert sorted(tree(committed.parent)) == sorted([*before, beside.name, beside.with_suffix(".png").name])
    assert json.loads(beside.read_text())["setup"]["steps"] == 1 and list(report["models"]) == ["source",
                                                                                             "source_linear"]
    # the same setup again replaces its own report beside the committed one (and reuses its figures)
    again = bench.main(flags)
    assert again["models"] == report["models"] and tree(committed.parent).items() >= before.items()


def test_a_fresh_checkout_with_the_default_setup_reuses_every_committed_figure(tmp_path):
    """The committed report is this benchmark's, of the default setup: a default run reads it (read only here) and
    would replace it, reusing every model."""
    if not COMMITTED.is_file():
        pytest.skip("no committed report")
    args = bench.build_parser().parse_args([])
    setup = {k: (str(v) if isinstance(v, bench.Path) else v) for k, v in vars(args).items()
             if k not in ("retrain", "readme_only", "results", "models")}
    assert bench.report_target(args.results, setup, bench.check_report, bench.LABEL) == COMMITTED
    previous = bench.read_report(COMMITTED, bench.check_report, bench.LABEL)
    names = [n for n in previous["models"] if n not in bench.ROPE_SCALING]
    runs = owned.OutputFolder(tmp_path / "runs", bench.SCRIPT)
    reused, commands = bench.reusable_records(args, names, previous, runs)
    assert set(reused) == set(previous["models"]) and commands == previous["commands"]
    assert not (tmp_path / "runs").exists()


def test_a_report_of_the_same_setup_is_replaced_and_rewrites_the_tables_when_committed(tmp_path, stubbed,
                                                                                       monkeypatch):
    results = tmp_path / "lc.json"
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", results)
    flags = [*TINY, "--output_dir", str(tmp_path / "runs"), "--results", str(results)]
    bench.main(flags)
    assert json.loads(results.read_text())["benchmark"] == "long_context"
    assert all("| source | 100% | 100% |" in page.read_text() for page in stubbed)
    bench.main([*flags, "--retrain"])  # the same setup: its own report, replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lc.json", "lc.png", "pages", "runs"]


# -- --readme_only ---------------------------------------------------------------------------------------------
def valid_report() -> dict:
    lengths, buckets = ["32", "64"], {"0-1x": 1.5, "1-2x": 1.6}
    entry = {"passkey": dict.fromkeys(lengths, 1.0), "bits_per_dim_by_position": buckets, "lm_eval": None,
             "state_bytes": dict.fromkeys(lengths, 100), "train_loss_by_step": [[100, 1.0]], "answer_weight": 30.0,
             "family": "softmax"}
    return {"setup": {"block_size": 32, "length_multiples": [1, 2], "steps": 1},
            "designs": {"source": ["softmax", []]}, "models": {"source": entry}, "commands": []}


def edited(change) -> str:
    report = valid_report()
    change(report)
    return json.dumps(report)


BAD_REPORTS = {
    "missing": (None, "does not exist"),
    "not JSON": ('{"setup": ', r"is not valid JSON \(Expecting value: line 1 column 11"),
    "a list": ("[1, 2]", r"holds a JSON list, not a report of benchmarks/long_context\.py"),
    "no length_multiples": (edited(lambda r: r["setup"].pop("length_multiples")),
                            "'setup' has no 'length_multiples' \\(a list of positive integers\\)"),
    "models not an object": (edited(lambda r: r.update(models=[])), "its 'models' is a JSON list, not a JSON object"),
    "passkey of a wrong type": (edited(lambda r: r["models"]["source"].update(passkey="high")),
                                "'models' entry 'source' has no 'passkey' figures"),
    "a design contradicting DESIGNS": (edited(lambda r: r["designs"].update(source=["window", ["window_size=8"]])),
                                       "'designs' gives 'source' as \\['window', \\['window_size=8'\\]\\], but the "
                                       "benchmark's source is \\['softmax', \\[\\]\\]"),
    "a family contradicting DESIGNS": (edited(lambda r: r["models"]["source"].update(family="window")),
                                       "'models' entry 'source' gives family 'window', but the benchmark's source has "
                                       "'softmax'"),
    "a model the benchmark has not": (edited(lambda r: r["models"].update(mine=r["models"]["source"])),
                                      "'models' names 'mine', not a model of the benchmark"),
    "another benchmark's": (edited(lambda r: r.update(benchmark="uptraining")),
                            "it is marked as a report of 'uptraining'"),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_readme_only_names_the_file_and_what_is_wrong_and_writes_nothing(case, tmp_path, stubbed, monkeypatch):
    text, message = BAD_REPORTS[case]
    path = tmp_path / "results" / "lc.json"
    path.parent.mkdir()
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", path)  # were it published, it would rewrite the tables
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=message) as refused:
        bench.main(["--readme_only", "--results", str(path)])
    assert str(refused.value).startswith(f"--results {path} ")
    assert tree(tmp_path) == before


def test_readme_only_of_a_valid_report_recomputes_it(tmp_path, stubbed, monkeypatch):
    path = tmp_path / "lc.json"
    path.write_text(json.dumps(valid_report()))
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", path)
    report = bench.main(["--readme_only", "--results", str(path)])
    assert report["summary"]["rows"]["source"]["passkey"] == {"32": 1.0, "64": 1.0}
    assert "| source | 100% | 100% |" in stubbed[0].read_text() and path.with_suffix(".png").is_file()


def test_the_command_line_prints_one_line_not_a_traceback(tmp_path, monkeypatch):
    """The script as `python benchmarks/long_context.py ...` runs it (its __main__ block, in this process): a
    refusal exits with status 1 and one line naming the file, which Python prints without a traceback."""
    bad = tmp_path / "lc.json"
    bad.write_text("[]")
    users_train_lm_run(tmp_path / "mine" / "source")
    before = tree(tmp_path)
    for flags, named in ((["--readme_only", "--results", str(bad)], f"--results {bad} holds a JSON list"),
                         (["--models", "source", "--steps", "1", "--output_dir", str(tmp_path / "mine"),
                           "--results", str(tmp_path / "new.json")], f"--output_dir {tmp_path / 'mine'} holds")):
        monkeypatch.setattr(sys, "argv", ["benchmarks/long_context.py", *flags])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(ROOT / "benchmarks" / "long_context.py"), run_name="__main__")
        message = exited.value.code  # a string: Python prints it to stderr and exits with status 1
        assert isinstance(message, str) and message.startswith(f"benchmarks/long_context.py: error: {named}")
        assert "\n" not in message
    assert tree(tmp_path) == before


# -- the other benchmarks that train through train_lm.py ----------------------------------------------------------
TRAINING_BENCHMARKS = ("uptraining", "llama_uptraining", "conversion_recovery")


@pytest.mark.parametrize("name", TRAINING_BENCHMARKS)
def test_the_uptraining_benchmarks_refuse_a_users_run_and_json(name, tmp_path, monkeypatch):
    """They passed --overwrite_output_dir and deleted folders with shutil.rmtree, and replaced any --results."""
    module = load_module(ROOT / "benchmarks", name)
    monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail("a command ran before the refusal"))
    users_train_lm_run(tmp_path / "mine" / "source")
    (tmp_path / "mine.json").write_text('{"my": "scores"}')
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=f"--output_dir {tmp_path / 'mine'} holds files that are not a run"):
        module.main(["--output_dir", str(tmp_path / "mine"), "--results", str(tmp_path / "new.json")])
    with pytest.raises(owned.Refused, match=f"--results {tmp_path / 'mine.json'} is not a report of "
                                            f"benchmarks/{name}.py: it has no 'setup'"):
        module.main(["--output_dir", str(tmp_path / "runs"), "--results", str(tmp_path / "mine.json")])
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", TRAINING_BENCHMARKS)
def test_the_committed_reports_are_their_benchmarks_own(name):
    """The committed reports (from before reports were marked) are recognised, so a run of their own setup
    replaces them and no other does."""
    module = load_module(ROOT / "benchmarks", name)
    committed = ROOT / "benchmarks" / "results" / f"{name}.json"
    report = json.loads(committed.read_text())
    check = module.REPORT_CHECK if hasattr(module, "REPORT_CHECK") else owned.require_keys(
        *module.REPORT_KEYS, benchmark=name)
    assert owned.report_target(committed, report["setup"], check, name) == committed
    other = {**report["setup"], "seed": 1}
    assert owned.report_target(committed, other, check, name) == owned.beside(committed, other)


def test_readme_only_of_the_llama_benchmarks_names_a_bad_file(tmp_path):
    for name in ("llama_uptraining", "conversion_recovery"):
        module = load_module(ROOT / "benchmarks", name)
        bad = tmp_path / f"{name}.json"
        bad.write_text("[1]")
        with pytest.raises(owned.Refused, match=f"--results {bad} holds a JSON list"):
            module.main(["--readme_only", "--results", str(bad)])


def test_causal_lara_lm_and_train_lm_variants_refuse_a_users_run_and_json(tmp_path, monkeypatch):
    """Both passed --overwrite_output_dir to train_lm.py themselves; train_lm_variants also wrote any `output`."""
    import yaml

    lara, variants = (load_module(ROOT / "benchmarks", name) for name in ("causal_lara_lm", "train_lm_variants"))
    monkeypatch.setattr(lara, "train_lm", lambda: pytest.fail("trained before the refusal"))
    monkeypatch.setattr(variants, "run_variant", lambda *a: pytest.fail("trained before the refusal"))
    users_train_lm_run(tmp_path / "mine" / "softmax")
    (tmp_path / "mine.json").write_text('{"my": "scores"}')
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(yaml.safe_dump({"experiment": "tiny", "output": str(tmp_path / "mine.json"),
                                          "train_lm": {"family": "softmax"}, "variants": {"softmax": {}}}))
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=f"--output_dir {tmp_path / 'mine'} holds"):
        lara.main(["--output_dir", str(tmp_path / "mine")])
    with pytest.raises(owned.Refused, match=f"--output_dir {tmp_path / 'mine'} holds"):
        variants.main([str(experiment), "--output_dir", str(tmp_path / "mine")])
    with pytest.raises(owned.Refused, match=f"output: {tmp_path / 'mine.json'} is not a report of "
                                            "benchmarks/train_lm_variants.py"):
        variants.main([str(experiment), "--output_dir", str(tmp_path / "runs")])
    assert tree(tmp_path) == before


def test_a_script_pointed_at_a_benchmarks_folder_names_it_and_refuses(tmp_path):
    """The other way round: train_lm.py (run_dir's rule) neither writes into nor empties a benchmark's folder."""
    from argparse import Namespace

    from attnzoo.training.run_dir import check_output_dir

    runs = owned.OutputFolder(tmp_path / "runs", bench.SCRIPT)
    runs.write_record("source", "command", ["x"])
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=r"already holds files: the runs of benchmarks/long_context\.py \(records, "
                                         r"run_args\.json\)"):
        check_output_dir(Namespace(output_dir=str(tmp_path / "runs")), "train_lm")
    with pytest.raises(ValueError, match="which this command did not make"):
        check_output_dir(Namespace(output_dir=str(tmp_path / "runs"), overwrite_output_dir=True), "train_lm")
    assert tree(tmp_path) == before
