"""benchmarks/pretrained_long_context.py on a tiny random Llama (the real GGUF is the benchmark's, not the tests'):
every design is converted once into the models folder and reused, each cell's row lands in the JSON as it is
measured, a rerun measures nothing new (--remeasure redoes the chosen cells), the summary, plot and table come from
the results file, and bad arguments or a foreign results file are refused with nothing written."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.scripts_helpers import ROOT, load_module, save_tiny_llama

bench = load_module(ROOT / "benchmarks", "pretrained_long_context")
#: a window of 32 (+ 4 sinks) in 320-token prompts: every far part has far keys to read; past the source's 256
#: positions, so the rope designs run too
SMALL = ["--window_size", "32", "--block_size", "16", "--block_topk", "1", "--wide_block_topk", "2",
         "--lsh_chunk_length", "16",
         "--lsh_num_hashes", "2", "--far_position_group", "4", "--threads", "1", "--lengths", "320",
         "--fillers", "repeat", "--depths", "0.5", "--trials", "1", "--retrieval_top", "1",
         "--calibration_length", "256", "--calibration_prompts", "2", "--calibration_distance", "4",
         "--attributed_top", "1", "--attributed_kv_heads", "1", "--attribution_prompts", "1", "--attribution_steps",
         "2", "--centred_buckets", "4", "--centred_hashes", "3", "--centred_chunks_before", "2",
         "--centroid_buckets", "6", "--centroid_probes", "2", "--centroid_chunks_before", "2",
         "--member_mean_block", "64", "--wide_chunks_before", "4"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, positions=256)


@pytest.fixture
def measured(monkeypatch):
    """The jobs `measure` (a passkey cell) and `measure_loss` (a loss cell, "loss" set) are given; the loss is
    computed 100 positions at a time, so a 320-token document takes several chunks."""
    calls = []

    def counted(measure, **mark):
        def run(job):
            calls.append({**job, **mark})
            return measure(job)
        return run

    monkeypatch.setattr(bench, "measure", counted(bench.measure))
    monkeypatch.setattr(bench, "measure_loss", counted(bench.measure_loss, loss=True))
    monkeypatch.setattr(bench, "LOSS_CHUNK", 100)
    return calls


def run(tmp_path, source, *extra):
    return bench.main(["--source", str(source), "--models_dir", str(tmp_path / "models"),
                       "--results", str(tmp_path / "plc.json"), *SMALL, *extra])


def test_a_tiny_grid_fills_each_cell_once_and_reports_from_its_results(tmp_path, source, measured, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench.MARKERS[0]}\nold\n{bench.MARKERS[1]}\n")
    monkeypatch.setattr(bench, "README", readme)
    report = run(tmp_path, source)
    saved = json.loads((tmp_path / "plc.json").read_text())
    assert saved["rows"] == report["rows"] and saved["benchmark"] == bench.LABEL
    assert {tuple(r[k] for k in bench.KEY) for r in saved["rows"]} == {
        (d, 320, "repeat", 0.5, 0) for d in bench.DESIGN_NAMES}
    for row in saved["rows"]:
        assert isinstance(row["correct"], bool) and len(row["passkey"]) == 5
        assert row["prefill_s"] > 0 and row["cell_s"] >= row["prefill_s"] and row["state_bytes"] > 0
        assert row["decode_steps"] >= 1 and row["decode_tokens_per_s"] > 0
    rows = {r["design"]: r for r in saved["rows"]}
    assert rows["source_linear"]["rope"] == {"rope_type": "linear", "factor": 320 / 256}
    assert rows["source_dynamic"]["rope"] == {"rope_type": "dynamic", "factor": 2.0}
    # the source's KV cache: 1 layer x keys and values x 2 heads x 8 dims x 4 bytes a token; the window's ring is
    # W + sinks = 36 slots, whatever the length
    assert rows["source"]["state_bytes"] == 320 * 2 * 2 * 8 * 4
    assert rows["window"]["state_bytes"] < rows["source"]["state_bytes"]
    # block_bounded: the far part in the one layer the calibration ranked first (of one), its scores in the report
    assert saved["calibration"]["block_bounded"]["top"] == [0]
    assert len(saved["calibration"]["block_bounded"]["layer_scores"]) == 1
    bounded = json.loads(next((tmp_path / "models").glob("block_bounded-*/config.json")).read_text())
    assert bounded["attn_layers"] == ["block_window"]
    # block_fixed_wide: block_fixed's layout with its own number of blocks
    fixed, wide = (json.loads(next((tmp_path / "models").glob(f"{name}-*/config.json")).read_text())
                   for name in ("block_fixed", "block_fixed_wide"))
    assert (fixed["block_topk"], wide["block_topk"]) == (1, 2)
    assert {k: v for k, v in wide.items() if k != "block_topk"} == {k: v for k, v in fixed.items() if k != "block_topk"}
    # block_wide_quantised: block_fixed_wide's layout, its far keys in 8 bits and values in 4: every head's far keys
    # in fewer bytes than block_fixed_wide's
    quantised = json.loads(next((tmp_path / "models").glob("block_wide_quantised-*/config.json")).read_text())
    assert (quantised["block_key_bits"], quantised["block_value_bits"]) == (8, 4)
    assert (wide["block_key_bits"], wide["block_value_bits"]) == (None, None)
    assert {k: v for k, v in quantised.items() if not k.endswith("_bits")} == {
        k: v for k, v in wide.items() if not k.endswith("_bits")}
    assert rows["block_wide_quantised"]["state_bytes"] < rows["block_fixed_wide"]["state_bytes"]
    # block_attributed: calibrated on block_fixed's own far parts (their attributions, one per layer)
    attributed = json.loads(next((tmp_path / "models").glob("block_attributed-*/calibration.json")).read_text())
    assert attributed["method"] == "attribution" and attributed["far_layers"] == [0] and attributed["top"] == [0]
    assert saved["calibration"]["block_attributed"]["settings"]["steps"] == 2
    # block_heads: the same calibration's scores (reused, not computed again), the far part in its best key-value
    # head alone, so its decoding state holds half of block_fixed's far keys
    heads = json.loads(next((tmp_path / "models").glob("block_heads-*/calibration.json")).read_text())
    assert heads["reused_from"].startswith("block_attributed-") and "reused_from" not in attributed
    assert heads["head_scores"] == attributed["head_scores"]
    best = max(range(2), key=lambda h: (heads["kv_head_scores"][0][h], -h))
    assert heads["top_kv_heads"] == {"0": [best]}
    config = json.loads(next((tmp_path / "models").glob("block_heads-*/config.json")).read_text())
    assert config["attn_layers"] == ["block_window"] and config["far_kv_heads"] == [[best]]
    assert rows["window"]["state_bytes"] < rows["block_heads"]["state_bytes"] < rows["block_fixed"]["state_bytes"]
    # lsh_heads: the same heads and scores, LSH's far part (separate QK) in them
    lsh_heads = json.loads(next((tmp_path / "models").glob("lsh_heads-*/calibration.json")).read_text())
    assert lsh_heads["reused_from"].startswith("block_attributed-") and lsh_heads["top_kv_heads"] == {"0": [best]}
    config = json.loads(next((tmp_path / "models").glob("lsh_heads-*/config.json")).read_text())
    assert config["attn_layers"] == ["lsh_window"] and config["far_kv_heads"] == [[best]]
    assert config["lsh_shared_qk"] is False and config["far_positions"] == ["fixed"]
    assert rows["window"]["state_bytes"] < rows["lsh_heads"]["state_bytes"] < rows["lsh_fixed"]["state_bytes"]
    # dense_fixed: every far key, exactly, at distance W: it keeps them all, as the source's KV cache does
    config = json.loads(next((tmp_path / "models").glob("dense_fixed-*/config.json")).read_text())
    assert config["attn_layers"] == ["dense_window"] and config["far_positions"] == ["fixed"]
    assert rows["dense_fixed"]["state_bytes"] >= rows["source"]["state_bytes"]
    # lsh_heads_centred: the same heads, its own LSH settings, and key centres set from the corpus's last tokens
    centred = json.loads(next((tmp_path / "models").glob("lsh_heads_centred-*/calibration.json")).read_text())
    assert centred["top_kv_heads"] == {"0": [best]} and centred["key_centres"]["tokens"] == 256
    config = json.loads(next((tmp_path / "models").glob("lsh_heads_centred-*/config.json")).read_text())
    assert config["far_kv_heads"] == [[best]] and config["lsh_centre_keys"] is True
    assert (config["lsh_num_buckets"], config["lsh_num_hashes"], config["lsh_num_chunks_before"]) == (4, 3, 2)
    folder = next((tmp_path / "models").glob("lsh_heads_centred-*"))
    centre = AutoModelForCausalLM.from_pretrained(folder).model.transformer.blocks[0].attn.lsh_key_centre
    assert centre.shape == (1, 8) and centre.norm(dim=-1).tolist() == pytest.approx(
        centred["key_centres"]["centre_norms"]["0"]) and centre.abs().sum() > 0
    # lsh_heads_centroids: the same heads and centres, and k-means centroids fitted to the same tokens' keys
    learned = json.loads(next((tmp_path / "models").glob("lsh_heads_centroids-*/calibration.json")).read_text())
    assert learned["top_kv_heads"] == {"0": [best]} and learned["key_centres"]["tokens"] == 256
    config = json.loads(next((tmp_path / "models").glob("lsh_heads_centroids-*/config.json")).read_text())
    assert config["far_kv_heads"] == [[best]] and config["lsh_key_centroids"] is True
    assert (config["lsh_num_buckets"], config["lsh_num_hashes"], config["lsh_num_chunks_before"]) == (6, 2, 2)
    attn = AutoModelForCausalLM.from_pretrained(next((tmp_path / "models").glob("lsh_heads_centroids-*"))
                                                ).model.transformer.blocks[0].attn
    assert attn.lsh_key_centroids.shape == (1, 6, 8) and attn.lsh_key_centroids.abs().sum() > 0
    assert attn.lsh_key_centroids.norm(dim=-1).median(-1).values.tolist() == pytest.approx(
        learned["key_centres"]["centroid_norms_median"]["0"])
    torch.testing.assert_close(attn.lsh_key_centre, centre)  # the centres lsh_heads_centred has
    # lsh_heads_member_means: lsh_heads_centroids' model read with lsh_member_mean_block, its buffers as they were
    means_folder = next((tmp_path / "models").glob("lsh_heads_member_means-*"))
    read = json.loads((means_folder / "calibration.json").read_text())
    assert read["read_from"].startswith("lsh_heads_centroids-") and read["top_kv_heads"] == {"0": [best]}
    assert read["read_settings"] == {"lsh_member_mean_block": 64}
    assert read["settings"] == learned["settings"]  # the calibration's own, as lsh_heads_centroids records them
    means_model = AutoModelForCausalLM.from_pretrained(means_folder)
    assert means_model.config.lsh_member_mean_block == 64 and means_model.config.far_kv_heads == [[best]]
    wide = AutoModelForCausalLM.from_pretrained(next((tmp_path / "models").glob("lsh_heads_member_means_wide-*")))
    assert (wide.config.lsh_member_mean_block, wide.config.lsh_num_chunks_before) == (64, 4)  # K = 4 x 16
    assert wide.config.lsh_member_score == "mean"
    mass = AutoModelForCausalLM.from_pretrained(next((tmp_path / "models").glob("lsh_heads_member_mass_wide-*")))
    assert (mass.config.lsh_member_mean_block, mass.config.lsh_num_chunks_before,
            mass.config.lsh_member_score) == (64, 4, "log_mass")
    scaled = AutoModelForCausalLM.from_pretrained(next((tmp_path / "models").glob("lsh_heads_member_means_wide_log-*")))
    assert (scaled.config.lsh_num_chunks_before, scaled.config.far_query_scale) == (4, "log")
    assert wide.config.far_query_scale is None
    for got, kept in zip(means_model.state_dict().values(), AutoModelForCausalLM.from_pretrained(
            next((tmp_path / "models").glob("lsh_heads_centroids-*"))).state_dict().values(), strict=True):
        torch.testing.assert_close(got, kept, rtol=0, atol=0)
    # the part of the positive attribution each keeps its far part in: every head of the one layer, or the best head
    positive = [max(score, 0.0) for score in heads["kv_head_scores"][0]]
    assert saved["calibration"]["block_attributed"]["positive_share"] == 1.0
    assert saved["calibration"]["block_heads"]["positive_share"] == pytest.approx(
        positive[best] / sum(positive) if sum(positive) else 0.0)
    entry = saved["summary"]["window/320"]
    assert entry["cells"] == 1 and entry["cells_missing"] == 0
    assert entry["passkey"]["repeat"]["accuracy"] == float(rows["window"]["correct"])
    assert entry["state_over_source"] == pytest.approx(rows["window"]["state_bytes"] / rows["source"]["state_bytes"])
    # loss by position: one row per design; the source's is transformers' own loss on the same tokens
    assert {r["design"] for r in saved["loss_rows"]} == set(bench.DESIGN_NAMES)
    assert len([j for j in measured if j.get("loss")]) == len(bench.DESIGN_NAMES)
    losses = {r["design"]: r for r in saved["loss_rows"]}
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(source).eval()
        ids = torch.tensor([bench.document_ids(AutoTokenizer.from_pretrained(source), 320)])
        expected = model(ids, labels=ids).loss.item()
    assert losses["source"]["loss"] == pytest.approx(expected, rel=1e-5)
    assert list(losses["source"]["loss_by_position"]) == ["0-320"]
    assert saved["summary"]["source/320"]["loss"]["within_native_over_source"] == 1
    assert losses["window"]["loss"] != losses["source"]["loss"]  # a window of 32 reads less than the source
    assert "Loss (nats/token)" in bench.table(saved)
    assert (tmp_path / "plc.png").stat().st_size > 0
    assert "| window |" in bench.table(saved) and "320" in bench.table(saved)
    assert readme.read_text().count("old") == 1  # not the committed report: the README is left alone
    models = sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith("run_args"))
    assert [m.split("-")[0] for m in models] == ["block_attributed", "block_bounded", "block_fixed",
                                                 "block_fixed_wide", "block_heads", "block_wide_quantised",
                                                 "dense_fixed", "lsh_fixed", "lsh_grouped", "lsh_heads",
                                                 "lsh_heads_centred",
                                                 "lsh_heads_centroids", "lsh_heads_member_mass_wide",
                                                 "lsh_heads_member_means",
                                                 "lsh_heads_member_means_wide", "lsh_heads_member_means_wide_log",
                                                 "window"]

    # the same setup again: the cells are stored and the models kept, so nothing is measured or converted
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "models").glob("*/config.json")}
    measured.clear()
    run(tmp_path, source)
    assert measured == []
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "models").glob("*/config.json")} == stamps
    # a new depth measures only its own cells; --remeasure redoes only the chosen cells
    run(tmp_path, source, "--designs", "window", "--depths", "0.5", "1")
    assert [(j["design"], j["depth"]) for j in measured] == [("window", 1.0)]
    measured.clear()
    run(tmp_path, source, "--designs", "source", "--remeasure")
    assert [(j["design"], bool(j.get("loss"))) for j in measured] == [("source", False), ("source", True)]
    assert len(json.loads((tmp_path / "plc.json").read_text())["rows"]) == len(bench.DESIGN_NAMES) + 1
    # a model read from another's, once built, needs nothing else: its base gone, nothing is converted again
    import shutil

    shutil.rmtree(next((tmp_path / "models").glob("lsh_heads_centroids-*")))
    measured.clear()
    run(tmp_path, source, "--designs", "lsh_heads_member_means", "--depths", "0.5", "1")
    assert [(j["design"], j["depth"]) for j in measured] == [("lsh_heads_member_means", 1.0)]
    assert not list((tmp_path / "models").glob("lsh_heads_centroids-*"))


def test_a_design_added_since_keeps_the_report_and_a_changed_one_goes_beside(tmp_path, source, measured):
    """A report from before a design existed (no rows of it, its setup without it) is the same setup with the design
    added: a run extends it in place. A design's settings changed are another setup: that report goes beside."""
    run(tmp_path, source, "--designs", "window")
    target = tmp_path / "plc.json"
    earlier = json.loads(target.read_text())
    del earlier["setup"]["designs"]["block_attributed"]  # as written before block_attributed was a design
    target.write_text(json.dumps(earlier))
    measured.clear()
    report = run(tmp_path, source, "--designs", "window", "--depths", "0.5", "1")
    assert [(j["design"], j["depth"]) for j in measured] == [("window", 1.0)]  # the stored cell was kept
    assert "block_attributed" in json.loads(target.read_text())["setup"]["designs"] and len(report["rows"]) == 2
    assert list(tmp_path.glob("plc-*.json")) == []
    run(tmp_path, source, "--designs", "window", "--window_size", "48")
    assert len(json.loads(target.read_text())["rows"]) == 2 and len(list(tmp_path.glob("plc-*.json"))) == 1


def test_the_rope_designs_run_only_past_the_training_length_and_missing_cells_are_costed(tmp_path, source):
    report = run(tmp_path, source, "--designs", "source", "source_linear", "--lengths", "256", "320",
                 "--max_seconds", "0")
    assert report["rows"] == [] and report["loss_rows"] == []  # the budget was spent before the first cell
    assert report["summary"]["source/256"]["cells_missing"] == 1
    assert "source_linear/256" not in report["summary"] and report["summary"]["source_linear/320"]["cells_missing"]
    report = run(tmp_path, source, "--designs", "source", "--lengths", "256")
    entry = json.loads((tmp_path / "plc.json").read_text())["summary"]
    assert entry["source/256"]["cells"] == 1 and "estimated_seconds_missing" not in entry["source/256"]


@pytest.mark.parametrize("flag, value", [("--designs", "nope"), ("--lengths", "8"), ("--depths", "1.5"),
                                         ("--fillers", "lorem"), ("--trials", "0"), ("--dtype", "int8"),
                                         ("--sink_positions", "middle"), ("--block_query_size", "5"),
                                         ("--centred_buckets", "5"), ("--centred_hashes", "0"),
                                         ("--wide_block_topk", "0"), ("--quantised_key_bits", "2"),
                                         ("--quantised_value_bits", "16"), ("--ruler_batch", "0"),
                                         ("--centroid_buckets", "7"), ("--centroid_buckets", "5000"),
                                         ("--centroid_probes", "0"),
                                         ("--centroid_probes", "300"), ("--device", "tpu"),
                                         ("--device", "cuda:x"), ("--device", "cuda:")])
def test_bad_arguments_name_the_argument(tmp_path, source, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main(["--source", str(source), "--models_dir", str(tmp_path / "models"),
                    "--results", str(tmp_path / "plc.json"), flag, value])
    assert not (tmp_path / "models").exists() and not (tmp_path / "plc.json").exists()


def test_a_cuda_device_this_machine_lacks_is_refused(tmp_path, source, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device 'cuda:1': no such CUDA device is visible here; use --device cpu"):
        run(tmp_path, source, "--device", "cuda:1")
    assert not (tmp_path / "models").exists() and not (tmp_path / "plc.json").exists()


def test_a_gpu_run_is_its_own_report_beside_the_cpu_one(tmp_path, source, monkeypatch):
    """With --device cuda every cell is measured on that device, and the report, whose setup names the GPU, goes
    beside the CPU report of the same cells rather than into it (here with the device faked and the cells measured
    by a stand-in that records where it was asked to run)."""
    cells = ["--designs", "source", "block_wide_quantised", "--no_loss", "--no_ruler"]
    run(tmp_path, source, *cells)
    cpu_report = (tmp_path / "plc.json").read_text()
    asked = []

    def on_device(job):
        asked.append(job["device"])
        return {"correct": True, "passkey": "12345", "continuation": " 12345", "key_position": 0, "depth_used": 0.5,
                "rope": None, "prefill_s": 0.5, "decode_steps": 1, "decode_tokens_per_s": 2.0, "state_bytes": 8,
                "load_s": 0.0, "cell_s": 1.0}

    monkeypatch.setattr(bench, "device_problem", lambda device: None)
    monkeypatch.setattr(bench, "cuda_device_name", lambda device: "NVIDIA Stand-in")
    monkeypatch.setattr(bench, "measure", on_device)
    run(tmp_path, source, *cells, "--device", "cuda")
    assert asked == ["cuda", "cuda"] and (tmp_path / "plc.json").read_text() == cpu_report
    (gpu,) = [path for path in tmp_path.glob("plc*.json") if path.name != "plc.json"]
    saved = json.loads(gpu.read_text())
    assert saved["setup"]["device"] == saved["environment"]["device"] == "NVIDIA Stand-in"
    assert [row["prefill_s"] for row in saved["rows"]] == [0.5, 0.5]


def test_a_foreign_results_file_is_refused_and_left_as_it_was(tmp_path, source, measured):
    foreign = tmp_path / "plc.json"
    foreign.write_text('{"mine": 1}')
    with pytest.raises(sys.modules["owned_outputs"].Refused, match="plc.json"):  # the module the benchmark imports
        run(tmp_path, source)
    assert foreign.read_text() == '{"mine": 1}' and measured == [] and not (tmp_path / "models").exists()


def test_ruler_cells_run_lm_evals_own_task_offline_and_are_kept(tmp_path, source, monkeypatch):
    """lm-eval's niah_single_1 at 4,096 tokens (2 samples, one per lm-eval call) on the window design: one row per
    (design, task, length) with lm-eval's per-sample scores in document order, prompts of the asked length that
    lm-eval did not cut, the summary's and the table's RULER entries from the results file; a rerun measures nothing
    new. Where nltk's punkt_tab is not installed, an empty one is written beside the models and put on nltk's path
    for the run."""
    import nltk

    monkeypatch.setattr(nltk.data, "path", list(nltk.data.path))  # the run's addition goes with the test
    try:
        nltk.data.find("tokenizers/punkt_tab")
        had_punkt = True
    except LookupError:
        had_punkt = False
    calls = []
    monkeypatch.setattr(bench, "measure_ruler", lambda job, measure=bench.measure_ruler: calls.append(job) or
                        measure(job))
    ruler = ["--designs", "window", "--lengths", "4096", "--no_loss", "--ruler_tasks", "niah_single_1",
             "--ruler_samples", "2", "--ruler_batch", "1"]
    report = run(tmp_path, source, *ruler)
    saved = json.loads((tmp_path / "plc.json").read_text())
    assert saved["ruler_rows"] == report["ruler_rows"] and [job["doc_ids"] for job in calls] == [[0], [1]]
    (row,) = saved["ruler_rows"]
    assert (row["design"], row["task"], row["length"], row["samples"]) == ("window", "niah_single_1", 4096, 2)
    assert row["doc_ids"] == [0, 1] and len(set(map(tuple, row["answers"]))) == 2  # two documents, not one twice
    # lm-eval's string match, sample by sample: every expected answer inside the reply
    for score, answers, reply in zip(row["sample_scores"], row["answers"], row["replies"], strict=True):
        assert score == sum(a.lower() in reply.lower() for a in answers) / len(answers)
    assert row["score"] == pytest.approx(sum(row["sample_scores"]) / 2)
    assert all(2048 < n <= 4096 for n in row["prompt_tokens"])  # lm-eval sized them to the 4K task
    assert saved["summary"]["window/4096"]["ruler"] == {
        "niah_single_1": {"score": row["score"], "samples": 2, "samples_asked": 2}}
    assert "RULER (niah_single_1)" in bench.table(saved)
    assert (tmp_path / "models" / "nltk_data" / "tokenizers" / "punkt_tab" / "english").is_dir() != had_punkt
    run(tmp_path, source, *ruler)
    assert len(calls) == 2 and len(json.loads((tmp_path / "plc.json").read_text())["ruler_rows"]) == 1


def ruler_stand_in(calls: list, stop_after: int | None = None, lm_eval: str | None = None):
    """measure_ruler's stand-in: document i scores 1 unless i is 3, each call takes 10 s, measured by the lm-eval
    installed unless `lm_eval` says otherwise; after `stop_after` calls it returns None, as within_budget does once
    --max_seconds is spent."""
    from attnzoo.evaluation.harness import lm_eval_version

    def measure_part(job):
        if stop_after is not None and len(calls) >= stop_after:
            return None
        calls.append(job["doc_ids"])
        ids = job["doc_ids"]
        return {"score": sum(i != 3 for i in ids) / len(ids), "samples": len(ids), "doc_ids": ids,
                "sample_scores": [float(i != 3) for i in ids], "answers": [[str(i)] for i in ids],
                "replies": [f" {i}." for i in ids], "prompt_tokens": [4000 + i for i in ids], "rope": None,
                "lm_eval": lm_eval or lm_eval_version(), "cell_s": 10.0}
    return measure_part


def passkey_stand_in(job):
    return {"correct": True, "passkey": "12345", "continuation": " 12345", "key_position": 0, "depth_used": 0.5,
            "rope": None, "prefill_s": 0.5, "decode_steps": 1, "decode_tokens_per_s": 2.0, "state_bytes": 8,
            "load_s": 0.0, "cell_s": 1.0}


RULER_IN_PARTS = ["--designs", "window", "--lengths", "4096", "--no_loss", "--ruler_tasks", "niah_single_1",
                  "--ruler_samples", "5", "--ruler_batch", "2"]


def test_a_ruler_row_grows_in_parts_and_a_stopped_run_keeps_its_parts(tmp_path, source, monkeypatch):
    """--ruler_batch 2 of 5 samples: a run stopped after its first lm-eval call keeps a 2-sample row (documents 0
    and 1) that the summary and table mark as short of the 5 asked; the next run calls lm-eval only for the
    documents it lacks, [2, 3] then [4], and the row holds all five in document order."""
    monkeypatch.setattr(bench, "measure", passkey_stand_in)
    stopped = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(stopped, stop_after=1))
    run(tmp_path, source, *RULER_IN_PARTS)
    saved = json.loads((tmp_path / "plc.json").read_text())
    (row,) = saved["ruler_rows"]
    assert stopped == [[0, 1]] and (row["samples"], row["samples_asked"], row["doc_ids"]) == (2, 5, [0, 1])
    assert saved["summary"]["window/4096"]["ruler"]["niah_single_1"] == {"score": 1.0, "samples": 2,
                                                                        "samples_asked": 5}
    assert "| 100 (2 of 5) |" in bench.table(saved)
    went_on = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(went_on))
    run(tmp_path, source, *RULER_IN_PARTS)
    saved = json.loads((tmp_path / "plc.json").read_text())
    (row,) = saved["ruler_rows"]
    assert went_on == [[2, 3], [4]]
    assert row["doc_ids"] == [0, 1, 2, 3, 4] and row["sample_scores"] == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert row["answers"] == [[str(i)] for i in range(5)] and row["prompt_tokens"] == [4000 + i for i in range(5)]
    assert (row["score"], row["samples"], row["cell_s"]) == (pytest.approx(0.8), 5, 30.0)
    assert "| 80 (5) |" in bench.table(saved)
    run(tmp_path, source, *RULER_IN_PARTS)
    assert went_on == [[2, 3], [4]]  # complete: nothing more to measure


@pytest.mark.parametrize("why", ["remeasure", "other_lm_eval"])
def test_a_ruler_row_starts_again_when_remeasured_or_measured_by_another_lm_eval(tmp_path, source, monkeypatch,
                                                                                  why):
    """--remeasure, or a row another lm-eval release measured, starts again from document 0: parts of two
    evaluations are never merged."""
    monkeypatch.setattr(bench, "measure", passkey_stand_in)
    first = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(
        first, lm_eval="0.4.0" if why == "other_lm_eval" else None))
    run(tmp_path, source, *RULER_IN_PARTS[:-4], "--ruler_samples", "3", "--ruler_batch", "3")
    saved = json.loads((tmp_path / "plc.json").read_text())
    for row in saved["ruler_rows"]:  # as the rows measured in one call were written
        del row["doc_ids"], row["samples_asked"]
    (tmp_path / "plc.json").write_text(json.dumps(saved))
    again = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(again))
    run(tmp_path, source, *RULER_IN_PARTS, *(["--remeasure"] if why == "remeasure" else []))
    (row,) = json.loads((tmp_path / "plc.json").read_text())["ruler_rows"]
    assert first == [[0, 1, 2]] and again == [[0, 1], [2, 3], [4]]
    assert row["doc_ids"] == [0, 1, 2, 3, 4] and row["cell_s"] == 30.0


def test_a_ruler_row_from_one_call_grows_from_the_documents_it_holds(tmp_path, source, monkeypatch):
    """A row from before the parts (no doc_ids: lm-eval's first 3 documents, as --limit 3 chose them) grows from
    document 3."""
    monkeypatch.setattr(bench, "measure", passkey_stand_in)
    first = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(first))
    run(tmp_path, source, *RULER_IN_PARTS[:-4], "--ruler_samples", "3", "--ruler_batch", "3")
    saved = json.loads((tmp_path / "plc.json").read_text())
    for row in saved["ruler_rows"]:
        del row["doc_ids"], row["samples_asked"]
    (tmp_path / "plc.json").write_text(json.dumps(saved))
    again = []
    monkeypatch.setattr(bench, "measure_ruler", ruler_stand_in(again))
    run(tmp_path, source, *RULER_IN_PARTS)
    (row,) = json.loads((tmp_path / "plc.json").read_text())["ruler_rows"]
    assert again == [[3, 4]] and row["doc_ids"] == [0, 1, 2, 3, 4] and row["samples"] == 5


@pytest.mark.parametrize("tasks, says", [(["niah_single_2"], "punkt_tab"), (["niah_singel_1"], "niah_single_1")])
def test_ruler_tasks_that_cannot_run_are_refused_before_anything_is_written(tmp_path, source, tasks, says):
    import nltk

    if tasks == ["niah_single_2"]:
        try:
            nltk.data.find("tokenizers/punkt_tab")
            pytest.skip("punkt_tab is installed here: every RULER task can split its haystack")
        except LookupError:
            pass
    with pytest.raises(bench.BadArgument, match=f"--ruler_tasks.*{says}"):
        run(tmp_path, source, "--lengths", "4096", "--ruler_tasks", *tasks)
    assert not (tmp_path / "models").exists() and not (tmp_path / "plc.json").exists()
