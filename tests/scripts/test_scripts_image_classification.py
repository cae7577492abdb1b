"""scripts/train_image_classification.py end to end on a small rendered-digit image folder: the DeiT recipe through
timm (RandAugment, Mixup/CutMix, random erasing, label smoothing, drop path), top-1, evaluate.py, exact resume."""


import pytest
from transformers import AutoImageProcessor, AutoModelForImageClassification

from tests.scripts_helpers import (
    FAMILIES,
    QUIET,
    assert_identical_weights,
    copy_interrupted_run,
    results,
    run_script,
    tiny_model,
    weights,
    write_image_folders,
)

pytest.importorskip("timm")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_image_folders(tmp_path_factory.mktemp("glyphs"), image_size=16, per_class=6, validation=2)


def image_args(images, out, family, *extra):
    return ["--train_dir", images / "train", "--validation_dir", images / "validation", "--image_size", "16",
            "--patch_size", "4", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
            "--num_warmup_steps", "2", "--output_dir", out, *tiny_model(family, *extra), *QUIET]


@pytest.mark.parametrize("family", FAMILIES)
def test_deit_recipe_trains_and_reports_top1(tmp_path, images, family):
    out = tmp_path / "run"
    accuracy = run_script("train_image_classification",
                          [*image_args(images, out, family, "pooling=cls"), "--max_train_steps", "6",
                           "--logging_steps", "3"])
    found = results(out)
    assert found["eval_accuracy"] == accuracy and 0.0 <= accuracy <= 1.0 and found["num_eval_images"] == 20
    assert found["global_batch_size"] == 8 and found["learning_rate"] == pytest.approx(5e-4 * 8 / 512)
    model = AutoModelForImageClassification.from_pretrained(out)
    assert model.config.num_labels == 10 and model.config.id2label[3] == "3"
    assert model.config.drop_path_rate == 0.1 and model.config.pooling == "cls"
    processor = AutoImageProcessor.from_pretrained(out)
    from PIL import Image

    pixels = processor(images=Image.open(next((images / "validation" / "7").iterdir())), return_tensors="pt")
    assert model(**pixels).logits.shape == (1, 10)
    card = (out / "README.md").read_text()
    assert "type: accuracy" in card and f"value: {round(accuracy, 4)}" in card and "rand-m9-mstd0.5-inc1" in card
    evaluated = run_script("evaluate", ["--model_name_or_path", out])
    assert evaluated["task"] == "image_classification"
    assert evaluated["top1_accuracy"] == pytest.approx(accuracy)


def test_resume_with_random_augmentation_gives_identical_weights(tmp_path, images):
    """RandAugment, random erasing and Mixup/CutMix draw from the python, numpy and torch RNGs every batch; the
    checkpoint restores all three, so the resumed run sees the same augmented batches."""
    args = ["--max_train_steps", "8", "--checkpointing_steps", "3"]  # 60 images / 8: crosses an epoch end
    run_script("train_image_classification", [*image_args(images, tmp_path / "full", "performer"), *args])
    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 3)
    run_script("train_image_classification", [*image_args(images, resumed, "performer"), *args,
                                              "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(tmp_path / "full"), weights(resumed))


def test_bad_arguments_say_what_to_change(tmp_path, images):
    base = [*image_args(images, tmp_path / "o", "softmax"), "--max_train_steps", "3"]
    cases = [
        (["--per_device_train_batch_size", "7"], "even"),
        (["--patch_size", "5"], "patch_size"),
        (["--reprob", "2"], "reprob"),
        (["--mixup", "-1"], "mixup"),
        (["--train_dir", tmp_path / "nothing"], "does not exist"),
        (["--label_column", "species"], "species"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            run_script("train_image_classification", [*base, *extra])
