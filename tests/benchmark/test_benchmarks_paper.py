"""The scripts in benchmarks/ that reproduce "Reformer: The Efficient Transformer" (arXiv 2001.04451) at CPU scale
(duplication task, attention speed, photo patches, train_lm variants): their data and bookkeeping, and a tiny
end-to-end run of each."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from attnzoo.training.loop import new_model_config
from tests.scripts_helpers import ROOT, load_module, load_script

BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str):
    return load_module(BENCHMARKS, name)


def test_duplication_batches_are_0w0w_scored_on_the_second_copy():
    dup = load_benchmark("reformer_duplication")
    ids, labels = dup.duplication_batch(5, 9, 127, torch.Generator().manual_seed(0))
    assert ids.shape == (5, 20)
    assert (ids[:, 0] == 0).all() and (ids[:, 10] == 0).all()
    assert torch.equal(ids[:, 1:10], ids[:, 11:])
    assert ((ids[:, 1:10] >= 1) & (ids[:, 1:10] <= 127)).all()
    assert (labels[:, :11] == -100).all() and torch.equal(labels[:, 11:], ids[:, 11:])


def test_duplication_settings_and_their_attention():
    dup = load_benchmark("reformer_duplication")
    assert dup.rounds_of("full") is None and dup.rounds_of("lsh8") == 8
    for bad in ("lsh", "lshx", "local"):
        with pytest.raises(ValueError, match="'full' or 'lshN'"):
            dup.rounds_of(bad)
    args = type("Args", (), dict(word_length=15, num_symbols=127, hidden_size=32, intermediate_size=32, num_heads=2,
                                 chunk_length=4))()
    full, lsh = dup.model_config(args, "full"), dup.model_config(args, "lsh4")
    assert full.lsh_full_attention_threshold >= 32 and lsh.lsh_num_hashes == 4
    assert full.num_hidden_layers == 1 and full.attn_layers == ["lsh"]


def test_duplication_end_to_end(tmp_path):
    dup = load_benchmark("reformer_duplication")
    out = tmp_path / "dup.json"
    dup.main(["--word_length", "15", "--hidden_size", "32", "--intermediate_size", "32", "--num_heads", "2",
              "--chunk_length", "4", "--train_settings", "full", "lsh2", "--eval_settings", "full", "lsh1", "lsh2",
              "--train_steps", "3", "--batch_size", "4", "--eval_batches", "2", "--log_steps", "2", "--jobs", "2",
              "--output", str(out)])
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"full", "lsh2"}
    for result in report["results"].values():
        assert set(result["eval"]) == {"full", "lsh1", "lsh2"}
        assert all(0 <= cell["accuracy"] <= 100 and cell["loss"] > 0 for cell in result["eval"].values())
        assert [p["step"] for p in result["curve"]] == [2, 3]
    assert out.with_suffix(".png").stat().st_size > 0


def test_attention_speed_end_to_end(tmp_path):
    speed = load_benchmark("reformer_attention_speed")
    out = tmp_path / "speed.json"
    speed.main(["--total_tokens", "64", "--lengths", "16", "32", "64", "--attentions", "full", "lsh-2",
                "--hidden_size", "32", "--num_heads", "2", "--chunk_length", "8", "--repeats", "1", "--backward",
                "--output", str(out)])
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {"full", "lsh-2"}
    assert all(set(points) == {"16", "32", "64"} and min(points.values()) > 0 for points in report["seconds"].values())
    with pytest.raises(ValueError, match="do not divide"):
        speed.main(["--total_tokens", "64", "--lengths", "48", "--output", str(out)])
    with pytest.raises(ValueError, match="'full' or 'lsh-N'"):
        speed.attention_layer("lsh", type("Args", (), dict(hidden_size=32, num_heads=2, chunk_length=8))())


def test_photo_patches_split_train_and_validation_rows(tmp_path):
    prep = load_benchmark("prepare_photo_patches")
    prep.main(["--output_dir", str(tmp_path), "--patch_size", "8", "--train_patches", "40"])
    train, validation = np.load(tmp_path / "train.npy"), np.load(tmp_path / "validation.npy")
    assert train.shape == (40, 8, 8, 3) and train.dtype == np.uint8
    assert validation.shape[1:] == (8, 8, 3) and len(validation) > 100
    # the validation rows are not in the training part: no validation patch equals a training patch
    flat_train = {patch.tobytes() for patch in train}
    assert not any(patch.tobytes() in flat_train for patch in validation)
    with pytest.raises(ValueError, match="not found"):
        prep.main(["--output_dir", str(tmp_path), "--images", str(tmp_path / "missing.jpg")])


def test_variant_command_lines_merge_model_lists():
    variants = load_benchmark("train_lm_variants")
    argv = variants.command_line({"family": "reformer", "block_size": 64, "model": ["hidden_size=32"]},
                                 {"block_size": 32, "model": ["reversible=true"]}, ROOT / "runs" / "x")
    assert argv[argv.index("--block_size") + 1] == "32"
    assert argv[argv.index("--model") + 1:argv.index("--model") + 3] == ["hidden_size=32", "reversible=true"]
    assert argv[argv.index("--report_to") + 1] == "jsonl"


def test_variant_curves_keep_one_point_per_step_after_a_resume(tmp_path):
    variants = load_benchmark("train_lm_variants")
    logged = [{"step": 50, "train_bits_per_dim": 5.0}, {"step": 100, "train_bits_per_dim": 4.0},
              {"step": 100, "eval_bits_per_dim": 4.5},
              # killed after step 150, resumed from the checkpoint at step 100: step 150 is logged again
              {"step": 150, "train_bits_per_dim": 3.9}, {"step": 150, "train_bits_per_dim": 3.8},
              {"step": 200, "eval_bits_per_dim": 4.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
    held_out, train = variants.read_curves(tmp_path)
    assert held_out == [{"step": 100, "eval_bits_per_dim": 4.5}, {"step": 200, "eval_bits_per_dim": 4.1}]
    assert train == [{"step": 50, "train_bits_per_dim": 5.0}, {"step": 100, "train_bits_per_dim": 4.0},
                     {"step": 150, "train_bits_per_dim": 3.8}]


@pytest.mark.parametrize("recipe", ["reformer_shared_qk_reversible", "reformer_hash_rounds"])
def test_committed_experiments_give_valid_train_lm_runs(recipe, tmp_path):
    # Every variant of the committed experiment files: train_lm.py accepts its arguments and its model overrides make
    # a valid config, and the plot panels name defined variants (a typo would surface only after an hour of training).
    train_lm, variants = load_script("train_lm"), load_benchmark("train_lm_variants")
    spec = yaml.safe_load((BENCHMARKS / "recipes" / f"{recipe}.yaml").read_text())
    assert {n for panel in spec.get("panels", []) for n in panel} <= set(spec["variants"])
    configs = {}
    for name, variant in spec["variants"].items():
        argv = variants.command_line(spec["train_lm"], variant or {}, tmp_path / name)
        args = train_lm.build_parser().parse_args(argv[2:])
        train_lm.check_arguments(args)
        configs[name] = new_model_config(args.family, {"vocab_size": 256, "is_decoder": True}, args.model)
    assert len({config.to_json_string() for config in configs.values()}) > 1


@pytest.mark.slow
def test_train_lm_variants_end_to_end(tmp_path):
    variants = load_benchmark("train_lm_variants")
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(yaml.safe_dump({
        "experiment": "tiny", "output": str(tmp_path / "tiny.json"),
        "train_lm": {"family": "reformer", "corpus": "text", "block_size": 32, "per_device_train_batch_size": 2,
                     "max_train_steps": 4, "eval_steps": 2, "max_eval_batches": 2, "sample_tokens": 0,
                     "model": ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2",
                               "intermediate_size=64"]},
        "variants": {"regular": {"model": ["attn_layers=[full]", "reversible=false"]},
                     "reversible": {"model": ["attn_layers=[full]", "reversible=true"]}},
        "panels": [["regular", "reversible"]]}))
    variants.main([str(experiment), "--output_dir", str(tmp_path / "runs")])
    report = json.loads((tmp_path / "tiny.json").read_text())
    regular, reversible = report["variants"]["regular"], report["variants"]["reversible"]
    assert regular["num_parameters"] == reversible["num_parameters"]
    assert [p["step"] for p in regular["eval_curve"]] == [2, 4]
    assert (tmp_path / "tiny.png").stat().st_size > 0
    spec = yaml.safe_load(experiment.read_text())
    spec["variants"]["unfinished"] = {"model": ["attn_layers=[lsh]"]}
    experiment.write_text(yaml.safe_dump(spec))
    variants.main([str(experiment), "--output_dir", str(tmp_path / "runs"), "--partial"])
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert report["missing"] == ["unfinished"] and set(report["variants"]) == {"regular", "reversible"}
    with pytest.raises(ValueError, match="panels name variants"):
        experiment.write_text(yaml.safe_dump({**yaml.safe_load(experiment.read_text()), "panels": [["nope"]]}))
        variants.main([str(experiment)])


def test_lsh_far_paths_end_to_end(tmp_path):
    """The layer's sorted blocks and its dense reference are timed at every length, and the report gives their
    ratio."""
    paths = load_benchmark("lsh_far_paths")
    out = tmp_path / "far.json"
    paths.main(["--tokens", "128", "--lengths", "64", "128", "--repeats", "1", "--output", str(out)])
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {"sorted_blocks", "reference"}
    assert all(set(points) == {"64", "128"} and min(points.values()) > 0 for points in report["seconds"].values())
    assert report["blocks_over_reference_time"]["64"] == report["seconds"]["sorted_blocks"]["64"] / report[
        "seconds"]["reference"]["64"]
    assert report["candidates_per_query"] == 2 * 32 and out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(ValueError, match="divide --tokens"):
        paths.main(["--tokens", "128", "--lengths", "48", "--output", str(out)])
