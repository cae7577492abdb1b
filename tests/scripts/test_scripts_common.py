"""What the training scripts share (attnzoo/training): recipes, checkpoints, metrics, trackers, plots, model cards,
and the offline corpus builders. Fast: no training."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
from safetensors.torch import save_file

from attnzoo.training.checkpoints import (
    average_checkpoint_weights,
    checkpoint_dir,
    list_checkpoints,
    resolve_resume,
)
from attnzoo.training.metrics import bits_per_dim, bleu_scores
from attnzoo.training.model_card import bits_per_dim_result, bleu_results, build_model_card, top1_result
from attnzoo.training.plots import plot_curves
from attnzoo.training.recipes import parse_with_recipe
from attnzoo.training.tracking import JSONLinesTracker, build_trackers, read_metrics
from tests.scripts_helpers import ROOT, load_script, number_words

RECIPE_SCRIPTS = {"enwik8": "train_lm", "imagenet64": "train_lm", "quickstart_lm": "train_lm", "uptrain_lm": "train_lm",
                  "wmt14": "train_translation", "quickstart_translation": "train_translation",
                  "deit": "train_image_classification", "quickstart_image_classification": "train_image_classification"}


def recipe_script(path: Path) -> str:
    return next(script for key, script in RECIPE_SCRIPTS.items() if key in path.stem)


RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_lara_recipes_reproducing_the_paper_pin_the_official_noise_scale():
    """LARA's config default is the paper's sigma = 1 (consistent as proposals grow); the recipes that reproduce
    arXiv 2204.04667's tables pin the authors' code's sigma = d^-1/4, with which the reported models were trained."""
    from attnzoo import ZooLARAConfig

    assert ZooLARAConfig().sample_noise_std == "paper"
    lara_recipes = [path for path in RECIPES if path.stem.startswith("lara")]
    assert len(lara_recipes) == 5
    for path in lara_recipes:
        assert "- sample_noise_std=official" in path.read_text(), path.name


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_parses_and_builds_its_model_config(path):
    """Each paper recipe cites its sources; its keys are arguments of its script; its model builds wherever the
    family is registered (reformer/ra/lara recipes name a family that arrives with its own issue)."""
    from attnzoo.training.loop import new_model_config

    text = path.read_text()
    assert text.startswith("#") and ("arXiv" in text or "Quick start" in text), "cite where the numbers come from"
    script = load_script(recipe_script(path))
    args = parse_with_recipe(script.build_parser(), ["--recipe", str(path)])
    assert args.family in ("softmax", "performer", "reformer", "ra", "lara")
    from transformers import CONFIG_MAPPING

    if f"attnzoo_{args.family}" not in CONFIG_MAPPING:
        with pytest.raises(ValueError, match="not registered"):
            new_model_config(args.family, {}, args.model)
        return
    values = {"is_encoder_decoder": True, "pad_token_id": 0, "decoder_start_token_id": 1} \
        if "wmt14" in path.stem or "translation" in path.stem else {}
    config = new_model_config(args.family, values, args.model)
    assert config.model_type == f"attnzoo_{args.family}"
    if "deit_tiny" in path.stem:
        assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (192, 3, 12)
    if "deit_small" in path.stem:
        assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (384, 6, 12)
        assert args.lr_scaling_batch == 512 and args.learning_rate == 5e-4 and args.weight_decay == 0.05


def test_deit_recipe_numbers():
    script = load_script("train_image_classification")
    args = parse_with_recipe(script.build_parser(), ["--recipe", str(ROOT / "recipes" / "lara_deit_small.yaml")])
    assert (args.auto_augment, args.mixup, args.cutmix, args.label_smoothing, args.reprob, args.drop_path_rate) == \
        ("rand-m9-mstd0.5-inc1", 0.8, 1.0, 0.1, 0.25, 0.1)
    assert args.num_train_epochs == 300 and args.num_warmup_epochs == 10 and args.min_learning_rate == 1e-5
    assert "lara_num_samples=49" in args.model and "pooling=mean" in args.model


def test_randaugment_posterize_at_zero_bits_does_not_crash():
    """timm's PosterizeIncreasing reaches 0 bits at magnitude 10; Pillow >= 12 rejects that (see the script)."""
    pytest.importorskip("timm")
    from PIL import Image
    from timm.data.auto_augment import AugmentOp

    script = load_script("train_image_classification")
    args = script.build_parser().parse_args(["--image_size", "16", "--patch_size", "4", "--max_train_steps", "1"])
    script.build_transforms(args)
    op = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    out = op(Image.new("RGB", (8, 8), (200, 120, 40)))
    assert out.getpixel((0, 0)) == (0, 0, 0)


def _fake_checkpoint(folder: Path, value: float, counter: int):
    folder.mkdir(parents=True)
    save_file({"w": torch.full((2, 2), value), "count": torch.tensor(counter)}, str(folder / "model.safetensors"))


def test_checkpoints_resolve_skip_partial_saves_and_average(tmp_path):
    for step, value in ((2, 1.0), (4, 2.0), (6, 4.0)):
        _fake_checkpoint(checkpoint_dir(tmp_path, step), value, step)
    (tmp_path / "checkpoints" / "step_8.partial").mkdir()  # a save interrupted by a kill
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    assert resolve_resume(tmp_path, "latest") == (checkpoint_dir(tmp_path, 6), 6)
    assert resolve_resume(tmp_path / "nothing_yet", "latest") == (None, 0)
    assert resolve_resume(tmp_path, None) == (None, 0)
    with pytest.raises(ValueError, match="step_N"):
        resolve_resume(tmp_path, str(tmp_path))
    averaged = average_checkpoint_weights([checkpoint_dir(tmp_path, s) for s in (4, 6)])
    assert torch.equal(averaged["w"], torch.full((2, 2), 3.0)) and averaged["count"].item() == 6
    with pytest.raises(ValueError, match="no full model weights"):
        average_checkpoint_weights([tmp_path / "checkpoints" / "step_8.partial"])


def test_bleu_scores_match_sacrebleu_and_carry_signatures():
    hypotheses = ["Die Datei wurde nicht gefunden.", "Das Haus-Tür ist offen"]
    references = ["Die Datei wurde nicht gefunden!", "Die Haus-Tür ist offen"]
    scores = bleu_scores(hypotheses, references)
    assert scores["sacrebleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    intl = sacrebleu.metrics.BLEU(tokenize="intl", lowercase=True).corpus_score(hypotheses, [references])
    assert scores["sacrebleu_intl_uncased"]["score"] == pytest.approx(intl.score)
    expected = f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__}"
    assert scores["sacrebleu"]["signature"] == expected
    # compound splitting turns "Haus-Tür" into three tokens, so more n-grams match in the tokenised BLEU
    assert scores["tokenized_bleu"]["ref_len"] > scores["sacrebleu"]["ref_len"]
    assert bleu_scores(references, references)["tokenized_bleu"]["score"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="hypotheses"):
        bleu_scores(hypotheses, references[:1])


def test_bits_per_dim_is_token_weighted_nats_over_ln2():
    assert bits_per_dim(2 * 0.6931471805599453 * 10, 10) == pytest.approx(2.0)


def test_jsonl_tracker_keeps_the_last_record_of_a_redone_step_and_plots(tmp_path):
    tracker = JSONLinesTracker("run", tmp_path)
    tracker.store_init_configuration({"lr": 0.1})
    for step, loss in ((1, 3.0), (2, 2.5), (3, 2.0), (2, 2.25), (3, 1.75)):  # killed after step 3, resumed from 1
        tracker.log({"train_loss": torch.tensor(loss), "lr": 0.1}, step=step)
    tracker.log({"eval_bits_per_dim": 1.5}, step=3)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train_loss"]) for r in records] == [(1, 3.0), (2, 2.25), (3, 1.75)]
    assert records[-1]["eval_bits_per_dim"] == 1.5
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plot_curves(tmp_path / "missing.jsonl", tmp_path / "none.png") is None
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1}


def test_trackers_choice():
    assert build_trackers("none", "x", "r") == []
    assert isinstance(build_trackers("jsonl", "x", "r")[0], JSONLinesTracker)
    with pytest.raises(ValueError, match="report_to"):
        build_trackers("wandb", "x", "r")


def test_model_card_carries_metrics_recipe_and_steps(tmp_path):
    from huggingface_hub import ModelCard
    from transformers import AutoConfig

    import attnzoo  # noqa: F401

    config = AutoConfig.for_model("attnzoo_performer", hidden_size=32, num_attention_heads=2, is_decoder=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# a recipe\nlearning_rate: 0.1\n")
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), hub_model_id="me/model", model_name_or_path=None,
                           recipe=recipe, hub_token="secret", max_train_steps=7, model_card_template=None)
    bleu = bleu_scores(["a b c d"], ["a b c d"])
    evals = [bits_per_dim_result(1.234567, "enwik8", "enwik8", "test"), *bleu_results(bleu, "wmt14", "wmt/wmt14",
                                                                                       "test", "de-en"),
             top1_result(0.5, "imagenet-1k", "imagenet-1k", "validation")]
    card = build_model_card("causal_lm", args=args, config=config, num_parameters=12345,
                            results={"eval_bits_per_dim": 1.234567, "train_steps": 7}, eval_results=evals,
                            pipeline_tag="text-generation", corpus="enwik8", dataset_name="enwik8",
                            sequence_length=64, image_size=64)
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    results = loaded.data.eval_results
    assert [(r.metric_type, r.metric_value) for r in results][:2] == [("bits_per_dim", 1.2346), ("bleu", 100.0)]
    assert results[1].metric_config == bleu["sacrebleu"]["signature"]
    text = (tmp_path / "README.md").read_text()
    assert "# a recipe" in text and "Training steps:** 7" in text and "secret" not in text
    assert "attnzoo_performer" in text


def test_gettext_corpus_builder(tmp_path):
    prepare = load_script("prepare_gettext_corpus")
    catalogs = Path(prepare.DEFAULT_LOCALE_DIR)
    if not catalogs.is_dir():
        pytest.skip("no German gettext catalogs on this system")
    counts = prepare.write_corpus(tmp_path, catalogs, max_pairs=300)
    assert sum(counts.values()) == 300 and counts["train"] > counts["test"] > 0
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert set(row["translation"]) == {"de", "en"} and "%" not in row["translation"]["en"]


def test_number_words_fallback_corpus():
    assert number_words(21) == ("twenty-one", "einundzwanzig")
    assert number_words(345) == ("three hundred forty-five", "dreihundertfünfundvierzig")
    assert number_words(1) == ("one", "eins") and number_words(101)[1] == "einhunderteins"
