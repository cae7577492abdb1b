"""benchmarks/long_context.py: the summary against the goal, the distance buckets, the tables written from the
results file (no figure typed by hand), the argument checks, the figures of absent runs reused from the results; a
tiny end-to-end run (slow) trains, evaluates and reuses its cached runs and, in a fresh checkout, its results."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest

from tests.scripts_helpers import ROOT, in_process, load_module

bench = load_module(ROOT / "benchmarks", "long_context")
owned = importlib.import_module("owned_outputs")  # the module long_context.py imported (benchmarks/ is on the path)
uptraining = importlib.import_module("uptraining")  # whose `run` runs the benchmark's commands


def model_entry(passkey: list, bits: list, states: list | None):
    lengths = ["128", "256", "512"]
    return {"passkey": dict(zip(lengths, passkey, strict=True)),
            "bits_per_dim_by_position": dict(zip(["0-1x", "1-2x", "2-4x"], bits, strict=True)),
            "state_bytes": None if states is None else dict(zip(lengths, states, strict=True)), "cells": []}


def fake_report():
    setup = {"block_size": 128, "length_multiples": [1, 2, 4], "steps": 10}
    return {"setup": setup, "models": {
        "source": model_entry([1.0, 0.0, 0.0], [1.5, 3.0, 4.0], [100, 200, 400]),
        # retrieves at 4x, keeps its loss, smaller state: meets the goal (16x is absent here: its check passes
        # only where measured ...)
        "good": model_entry([1.0, 0.95, 0.92], [1.6, 1.6, 1.62], [80, 150, 300]),
        # ... this one's state grows past the source's KV cache
        "big": model_entry([1.0, 1.0, 1.0], [1.5, 1.5, 1.5], [100, 250, 500]),
        "source_linear": {"passkey": {"128": 1.0, "256": 0.5, "512": 0.1}, "state_bytes": None, "cells": [],
                          "bits_per_dim_by_position": {"1x": {"0-1x": 1.5}, "4x": {"0-1x": 1.7, "2-4x": 1.9}}}}}


def test_the_summary_judges_each_model_against_the_goal():
    summary = bench.summarise(fake_report())
    rows = summary["rows"]
    assert rows["good"]["bits_per_dim_growth_4x"] == pytest.approx(0.02)
    assert rows["big"]["state_over_source_kv"]["512"] == pytest.approx(1.25)
    assert rows["source_linear"]["bits_per_dim_1x"] == 1.5 and rows["source_linear"]["bits_per_dim_4x"] == 1.9
    assert rows["source_linear"]["state_over_source_kv"] is None
    assert summary["meets_goal"] == []  # 16x was not measured: no model can meet its part


def test_a_model_that_retrieves_at_4x_and_16x_with_a_small_state_meets_the_goal():
    lengths = ["32", "128", "512"]  # 1x, 4x and 16x of L = 32

    def entry(passkey, bits, states, endings=0.5):
        return {"passkey": dict(zip(lengths, passkey, strict=True)), "state_bytes": dict(zip(lengths, states,
                                                                                          strict=True)),
                "bits_per_dim_by_position": dict(zip(["0-1x", "1-4x", "4-16x"], bits, strict=True)),
                "lm_eval": {"endings/acc_norm": endings, "next_word/exact_match": 0.2,
                            "perplexity/bits_per_byte": 1.5}}

    report = {"setup": {"block_size": 32, "length_multiples": [1, 4, 16]}, "models": {
        "source": entry([1.0, 0.0, 0.0], [1.5, 3.0, 4.0], [100, 400, 1600]),
        "window": entry([0.0, 0.0, 0.0], [1.6, 1.6, 1.6], [10, 10, 10], endings=0.4),
        "good": entry([1.0, 0.9, 0.5], [1.6, 1.65, 1.7], [90, 300, 1000]),
        "forgetful": entry([1.0, 0.9, 0.5], [1.6, 1.66, 1.7], [90, 300, 1000]),  # loses 0.06 bits/dim at 4x
        "weak": entry([1.0, 0.89, 0.5], [1.6, 1.6, 1.6], [90, 300, 1000]),
        # retrieves and keeps its loss, but scores below the window on lm-eval
        "shallow": entry([1.0, 0.9, 0.5], [1.6, 1.6, 1.6], [90, 300, 1000], endings=0.3)}}
    summary = bench.summarise(report)
    assert summary["meets_goal"] == ["good"]
    assert summary["rows"]["window"]["lm_eval_recovery"] == pytest.approx((0.8 + 1 + 1) / 3)
    # the window with adjacent sinks scores higher: the bar is the higher of the two windows
    report["models"]["window_adjacent_sinks"] = entry([0.0, 0.0, 0.0], [1.6, 1.6, 1.6], [10, 10, 10], endings=0.55)
    assert bench.summarise(report)["meets_goal"] == []
    report["models"]["window_adjacent_sinks"] = entry([0.0, 0.0, 0.0], [1.6, 1.6, 1.6], [10, 10, 10], endings=0.45)
    assert bench.summarise(report)["meets_goal"] == ["good"]
    del report["models"]["window"]  # nothing to hold the lm-eval figure against: not met
    assert bench.summarise(report)["meets_goal"] == []


def test_retrieval_is_dated_by_the_loss_gap_to_the_window_floor():
    floor = [[100, 0.9], [200, 0.8], [300, 0.78], [400, 0.77]]
    report = fake_report()
    report["models"]["window"] = {**model_entry([0, 0, 0], [1.6, 1.6, 1.6], [10, 10, 10]), "train_loss_by_step": floor}
    report["models"]["good"]["train_loss_by_step"] = [[100, 0.9], [200, 0.75], [300, 0.6], [400, 0.35]]
    report["models"]["big"]["train_loss_by_step"] = [[100, 0.9], [200, 0.8], [300, 0.7], [400, 0.69]]  # 0.08 below
    # a run with another answer weight logs its loss on another scale: not dated against the floor
    report["models"]["unweighted"] = {**model_entry([0, 0, 0], [1.6, 1.6, 1.6], [10, 10, 10]), "answer_weight": 1.0,
                                      "train_loss_by_step": [[100, 0.5], [200, 0.4]]}
    # below the floor early only (learning the text faster), then level with it: not dated
    report["models"]["early"] = {**model_entry([0, 0, 0], [1.6, 1.6, 1.6], [10, 10, 10]),
                                 "train_loss_by_step": [[100, 0.7], [200, 0.79], [300, 0.77], [400, 0.76]]}
    # below, above once, below again to the end: dated from the last time it went below
    report["models"]["late"] = {**model_entry([0, 0, 0], [1.6, 1.6, 1.6], [10, 10, 10]),
                                "train_loss_by_step": [[100, 0.7], [200, 0.75], [300, 0.6], [400, 0.5]]}
    rows = bench.summarise(report)["rows"]
    assert "learns_retrieval_at_step" not in rows["unweighted"]
    assert rows["good"]["learns_retrieval_at_step"] == 300  # 0.18 below the floor's 0.78; 0.05 at step 200
    assert rows["big"]["learns_retrieval_at_step"] is None
    assert rows["early"]["learns_retrieval_at_step"] is None and rows["late"]["learns_retrieval_at_step"] == 300
    assert "learns_retrieval_at_step" not in rows["window"] and "learns_retrieval_at_step" not in rows["source"]
    report["summary"] = bench.summarise(report)
    text = bench.table(report)
    assert "| 300 |" in text and "| not in 10 |" in text


def test_distance_buckets_group_cells_by_the_keys_distance():
    cells = [{"accuracy": 1.0, "distance": 100}, {"accuracy": 0.0, "distance": 200}, {"accuracy": 0.5,
                                                                                        "distance": 300},
             {"accuracy": None, "distance": 90}]
    assert bench.distance_buckets(cells, 128, [1, 2, 4]) == {"0-1x": 1.0, "1-2x": 0.0, "2-4x": 0.5}


def valid_report():
    """A report as the benchmark writes it (its own model names and designs), for the setup of fake_report."""
    report = fake_report()
    models = report["models"]
    models["irope_softmax"], models["window"] = models.pop("good"), models.pop("big")
    report["designs"] = {n: list(bench.DESIGNS[n][:2]) for n in ("source", "irope_softmax", "window")}
    report["commands"] = []
    return report


def test_the_tables_are_written_from_the_results_file(tmp_path, monkeypatch):
    pages = []
    for name in ("README.md", "long_context.md"):
        page = tmp_path / name
        page.write_text(f"before\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
        pages.append(page)
    monkeypatch.setattr(bench, "TABLE_FILES", tuple(pages))
    results = tmp_path / "long_context.json"
    results.write_text(json.dumps(valid_report()))
    # a report that is not the committed one leaves the tables as they are ...
    bench.main(["--readme_only", "--results", str(results)])
    assert all("old" in page.read_text() for page in pages)
    # ... the committed one rewrites them
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", results)
    bench.main(["--readme_only", "--results", str(results)])
    for page in pages:
        text = page.read_text()
        assert "old" not in text and "| irope_softmax | 100% | 95% | 92% | 1.600 | 1.620 | 0.75x | - | - |" in text
        assert text.startswith("before\n") and text.endswith("after\n")
    committed = ROOT / "benchmarks" / "results" / "long_context.json"
    if committed.is_file():  # the committed tables are the committed results, rendered
        expected = bench.table(json.loads(committed.read_text()))
        for path in (ROOT / "README.md", ROOT / "docs" / "long_context.md"):
            assert expected in path.read_text(), f"{path} does not show the table of {committed}"


@pytest.mark.parametrize(("flag", "value", "message"), [("--steps", "0", "--steps=0"),
                                                        ("--passkey_fraction", "0", "--passkey_fraction=0.0"),
                                                        ("--length_multiples", "2", "1 among them"),
                                                        ("--scan_lengths", "0", "--scan_lengths=")])
def test_bad_arguments_say_what_to_change(flag, value, message):
    args = bench.build_parser().parse_args([flag, value])
    with pytest.raises(ValueError, match=message):
        bench.check_arguments(args)


def test_an_interrupted_run_of_the_same_command_resumes_and_any_other_starts_over(tmp_path):
    runs = bench.OutputFolder(tmp_path / "runs", bench.SCRIPT)
    folder, command = tmp_path / "runs" / "window", ["scripts/train_lm.py", "--max_train_steps", "3000"]
    assert runs.start_or_resume("window", command) == []  # nothing there yet
    (folder / "checkpoints" / "step_408").mkdir(parents=True)  # stopped by SIGTERM: its state was saved
    assert runs.start_or_resume("window", command) == ["--resume_from_checkpoint", "latest"]
    other = ["scripts/train_lm.py", "--max_train_steps", "4000"]
    assert runs.start_or_resume("window", other) == [] and not folder.exists()  # the benchmark's own run, cleared
    (folder / "checkpoints" / "step_100").mkdir(parents=True)
    # the record now names the other command: the first one's checkpoint is not taken for it
    assert runs.start_or_resume("window", command) == [] and not folder.exists()
    (folder / "checkpoints" / "step_100").mkdir(parents=True)
    assert runs.start_or_resume("window", command, retrain=True) == [] and not folder.exists()
    (tmp_path / "runs" / "source").mkdir()  # a folder whose run stopped before its first checkpoint
    assert runs.start_or_resume("source", command) == []
    record = json.loads((tmp_path / "runs" / "run_args.json").read_text())
    assert record["script"] == bench.SCRIPT and {"window", "source", "records"} <= set(record["outputs"])


def recorded_results(tmp_path, args_list):
    """A results file as the benchmark writes it, for the setup `args_list` gives, holding three models."""
    args = bench.build_parser().parse_args(args_list)
    setup = {k: (str(v) if isinstance(v, bench.Path) else v) for k, v in vars(args).items()
             if k not in ("retrain", "readme_only", "results", "models")}
    weight = args.passkey_answer_weight
    models = {"source": {"answer_weight": weight, "mark": "source"}, "source_linear": {"mark": "linear"},
              "window": {"answer_weight": weight, "mark": "window"},
              "window_adjacent_sinks": {"variant_of": "window", "inference_settings": {"sink_positions": "adjacent"},
                                        "mark": "adjacent"}}
    designs = {n: list(bench.DESIGNS[bench.design_of(n)][:2]) for n in ("source", "window", "window_adjacent_sinks")}
    commands = ["scripts/train_lm.py --family softmax --output_dir runs/long_context/source",
                "scripts/evaluate.py --model_name_or_path runs/long_context/source --output_file "
                "runs/long_context/lm_eval/source/lm_eval.json",
                "scripts/train_lm.py --family window --output_dir runs/long_context/window",
                "AutoModelForCausalLM.from_pretrained('runs/long_context/window', **{}).save_pretrained("
                "'runs/long_context/window_adjacent_sinks')"]
    args.results.write_text(json.dumps({"setup": setup, "designs": designs, "models": models, "commands": commands}))
    return args, setup


def test_figures_of_models_whose_runs_are_absent_are_reused_from_the_results(tmp_path):
    flags = ["--output_dir", str(tmp_path / "runs"), "--results", str(tmp_path / "lc.json")]
    args, setup = recorded_results(tmp_path, flags)
    names = ["source", "window", "window_adjacent_sinks", "irope_softmax"]
    runs = bench.OutputFolder(args.output_dir, bench.SCRIPT)

    def reuse():
        return bench.reusable_records(args, names, json.loads(args.results.read_text()), runs)

    reused, commands = reuse()
    # a fresh checkout: every recorded model is reused; the one not recorded is computed
    assert set(reused) == {"source", "source_linear", "window", "window_adjacent_sinks"}
    assert reused["source"]["mark"] == "source" and len(commands) == 4
    assert [bench.command_writes(c) for c in commands] == ["source", "source", "window", "window_adjacent_sinks"]
    assert bench.command_writes("-m attnzoo.convert.attention runs/x/source runs/x/converted/window_converted "
                                "--family window") == "window_converted"
    # a run of the benchmark's in --output_dir (finished or started) is read or resumed, not taken from the results
    runs.write_record("window", "command", [])
    assert set(reuse()[0]) == {"source", "source_linear", "window_adjacent_sinks"}
    # a variant computed needs its trained model's weights: that one is computed too
    runs.record_file("window", "command").unlink()
    runs.write_record("window_adjacent_sinks", "started", {})
    assert set(reuse()[0]) == {"source", "source_linear"}
    runs.record_file("window_adjacent_sinks", "started").unlink()
    # another design under the name, other inference settings or --retrain: nothing of it reused
    recorded = json.loads(args.results.read_text())
    recorded["designs"]["window"] = ["window", ["window_size=64"]]
    recorded["models"]["window_adjacent_sinks"]["inference_settings"] = {"sink_positions": "absolute"}
    args.results.write_text(json.dumps(recorded))
    assert set(reuse()[0]) == {"source", "source_linear"}
    del recorded["models"]["source_linear"]  # the source comes with its rope-scaling rows or is computed
    args.results.write_text(json.dumps(recorded))
    assert reuse()[0] == {}
    args.retrain = True
    assert reuse() == ({}, [])
    # another setup's report is not this setup's: its report goes beside it, and nothing of it is reused
    args.retrain = False
    recorded_results(tmp_path, flags)
    other = {**setup, "steps": 10}
    target = bench.report_target(args.results, other, lambda report: None, bench.LABEL)
    assert target == tmp_path / f"lc-{owned.setup_digest(other)}.json" and not target.exists()


@pytest.mark.slow
def test_a_tiny_run_trains_evaluates_and_reuses_its_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "TABLE_FILES", ())
    # the benchmark's commands (training, conversion, lm-eval), recorded as it records them, run in this process
    monkeypatch.setattr(uptraining, "run", in_process(uptraining.run))
    monkeypatch.setattr(bench, "run", uptraining.run)
    argv = ["--models", "source", "window", "window_converted", "irope_lsh_from_irope_softmax_8_rounds",
            "--finetune_steps", "2",
            "--steps", "3", "--batch", "2", "--block_size", "128", "--hidden", "32",
            "--layers", "4", "--heads", "2", "--length_multiples", "1", "2", "--passkey_depths", "0.5",
            "--passkey_trials", "1", "--heldout_sequences", "1", "--passkey_min_distance", "0", "--lm_eval_limit", "4",
            "--scan_lengths", "192",
            "--output_dir", str(tmp_path / "runs"), "--results", str(tmp_path / "lc.json")]
    report = bench.main(argv)
    assert list(report["models"]) == ["source", "source_linear", "window", "window_converted", "irope_softmax",
                                      "irope_lsh_from_irope_softmax", "irope_lsh_from_irope_softmax_8_rounds"]
    variant = report["models"]["irope_lsh_from_irope_softmax_8_rounds"]
    assert variant["inference_settings"] == {"lsh_num_hashes_eval": 8, "max_position_embeddings": 256}
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tmp_path / "runs" / "irope_lsh_from_irope_softmax_8_rounds")
    assert (config.lsh_num_hashes_eval, config.max_position_embeddings, config.lsh_num_hashes) == (8, 256, 2)
    assert report["models"]["irope_lsh_from_irope_softmax"]["converted_from"] == "irope_softmax"
    assert set(report["models"]["irope_softmax"]["passkey_scan"]) == {"192"}  # a model of LENGTH_SCAN
    assert "passkey_scan" not in report["models"]["window"]
    converted = report["models"]["window_converted"]
    assert converted["converted_from"] == "source" and converted["train_steps"] == 2
    assert converted["family"] == "window" and len(converted["train_loss_by_step"]) == 0  # logged every 100 steps
    window = report["models"]["window"]
    assert set(window["lm_eval"]) >= {"endings/acc_norm", "next_word/exact_match", "perplexity/bits_per_byte"}
    assert report["summary"]["rows"]["window"]["lm_eval_recovery"] > 0
    assert set(window["passkey"]) == {"128", "256"} and set(window["bits_per_dim_by_position"]) == {"0-1x", "1-2x"}
    assert window["state_bytes"]["256"] < report["models"]["source"]["state_bytes"]["256"]  # a window, not a cache
    assert (tmp_path / "lc.png").is_file()
    stamps = {name: (tmp_path / "runs" / name / "model.safetensors").stat().st_mtime
              for name in ("source", "window", "window_converted", "irope_lsh_from_irope_softmax_8_rounds")}
    again = bench.main(argv)  # every run and evaluation is read back, not redone
    assert again["commands"] == report["commands"] and again["models"]["window"] == window
    assert all((tmp_path / "runs" / n / "model.safetensors").stat().st_mtime == t for n, t in stamps.items())
    # a fresh checkout (the results, no runs): every figure is reused from the results, nothing is trained ...
    kept = tmp_path / "kept_runs"
    (tmp_path / "runs").rename(kept)
    fresh = bench.main(argv)
    assert fresh["models"] == again["models"] and fresh["commands"] == again["commands"]
    assert not (tmp_path / "runs").exists()
    # ... and a model added to it trains alone, unless it needs a trained model's weights
    models_end = argv.index("--finetune_steps")
    added = bench.main([*argv[:models_end], "window_adjacent_sinks", *argv[models_end:]])
    assert added["models"]["source"] == again["models"]["source"]  # reused
    assert (tmp_path / "runs" / "window" / "model.safetensors").is_file()  # retrained: the variant reads it
    assert not (tmp_path / "runs" / "source").exists()
    assert added["models"]["window_adjacent_sinks"]["inference_settings"] == {"sink_positions": "adjacent"}
    shutil.rmtree(tmp_path / "runs")
    kept.rename(tmp_path / "runs")
    committed = (tmp_path / "lc.json").read_bytes()
    # (two models and what they need: the rule is the same for every model, and each retrained model costs a run)
    fewer = ["--models", "window", "window_converted", *argv[models_end:]]
    changed = bench.main([*fewer[:fewer.index("--steps") + 1], "4", *fewer[fewer.index("--steps") + 2:]])
    assert changed["models"]["window"]["train_steps"] == 4  # other settings retrain, in the same folder
    # ... and their report goes beside the earlier setup's, which is left as it was
    assert (tmp_path / "lc.json").read_bytes() == committed
    beside = [p.name for p in tmp_path.glob("lc-*.json")]
    assert len(beside) == 1 and json.loads((tmp_path / beside[0]).read_text())["setup"]["steps"] == 4
    # a retrained source is converted and fine-tuned again
    tuned = tmp_path / "runs" / "window_converted" / "model.safetensors"
    assert tuned.stat().st_mtime > stamps["window_converted"]
    assert changed["models"]["window_converted"]["train_steps"] == 2
