"""Train a DeiT-style image classifier with any attnzoo family and report top-1 accuracy.

The DeiT recipe (Touvron et al., arXiv 2012.12877, as arXiv 2204.04667 §5.2 and appendix H.2 use it) through timm:
RandAugment rand-m9-mstd0.5-inc1, Mixup 0.8, CutMix 1.0 (switch probability 0.5), label smoothing 0.1, random erasing
0.25, drop path 0.1 (`drop_path_rate` in the config), AdamW with lr 5e-4 x global batch / 512 and weight decay 0.05
(none on norms, biases, position embeddings and the class token), cosine schedule with warm-up.

    python scripts/prepare_glyph_images.py --output_dir data/glyphs          # a small offline image set
    accelerate launch scripts/train_image_classification.py --recipe recipes/quickstart_image_classification.yaml
    accelerate launch scripts/train_image_classification.py --recipe recipes/lara_deit_tiny.yaml \
        --dataset_name ILSVRC/imagenet-1k

timm and torchvision (the `vision` extra) are imported by this script only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForImageClassification

from attnzoo.training.arguments import add_model_arguments, add_training_arguments, check_training_arguments
from attnzoo.training.classification_data import collate_images, load_labelled_images, with_transform
from attnzoo.training.loop import (
    VISION_NO_DECAY,
    RunningMean,
    build_accelerator,
    build_optimizer,
    eval_loader,
    log_and_checkpoint,
    new_model_config,
    prepare_run,
    progress_bar,
    save_final_model,
    train_batches,
    train_loader,
    training_record,
    training_step,
)
from attnzoo.training.metrics import evaluate_top1
from attnzoo.training.model_card import build_model_card, top1_result
from attnzoo.training.publish import publish_run
from attnzoo.training.recipes import parse_with_recipe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--train_dir", default=None, help="image folder, one sub-folder per class")
    data.add_argument("--validation_dir", default=None)
    data.add_argument("--dataset_name", default=None, help="a `datasets` dataset, e.g. imagenet-1k")
    data.add_argument("--dataset_config_name", default=None)
    data.add_argument("--image_column", default="image")
    data.add_argument("--label_column", default="label")
    data.add_argument("--train_val_split", type=float, default=0.15, help="held-out share when there is no split")
    data.add_argument("--max_train_samples", type=int, default=0)
    data.add_argument("--max_eval_samples", type=int, default=0)
    data.add_argument("--image_size", type=int, default=None,
                      help="image side (default: the checkpoint's with --model_name_or_path, else 224)")
    data.add_argument("--patch_size", type=int, default=16)
    aug = parser.add_argument_group("DeiT augmentation and regularisation")
    aug.add_argument("--auto_augment", default="rand-m9-mstd0.5-inc1", help="timm RandAugment policy ('' = off)")
    aug.add_argument("--color_jitter", type=float, default=0.3, help="used only when --auto_augment is off")
    aug.add_argument("--interpolation", default=None,
                      help="resize filter (default: the checkpoint's image processor's, else bicubic)")
    aug.add_argument("--crop_scale_min", type=float, default=0.08, help="RandomResizedCrop's smallest area share")
    aug.add_argument("--hflip", type=float, default=0.5, help="horizontal flip probability (0 for digits, text)")
    aug.add_argument("--reprob", type=float, default=0.25, help="random erasing probability")
    aug.add_argument("--mixup", type=float, default=0.8, help="Mixup alpha (0: off)")
    aug.add_argument("--cutmix", type=float, default=1.0, help="CutMix alpha (0: off)")
    aug.add_argument("--mixup_prob", type=float, default=1.0)
    aug.add_argument("--mixup_switch_prob", type=float, default=0.5)
    aug.add_argument("--label_smoothing", type=float, default=0.1)
    aug.add_argument("--drop_path_rate", type=float, default=0.1, help="stochastic depth of a new model")
    aug.add_argument("--eval_crop_pct", type=float, default=None,
                     help="evaluation: resize to size/pct, crop (default: the checkpoint's, else 0.875)")
    aug.add_argument("--image_mean", type=float, nargs=3, default=None,
                     help="normalisation mean (default: the checkpoint's image processor's, else ImageNet's)")
    aug.add_argument("--image_std", type=float, nargs=3, default=None,
                     help="normalisation std (default: the checkpoint's image processor's, else ImageNet's)")
    sched = parser.add_argument_group("DeiT learning rate")
    sched.add_argument("--lr_scaling_batch", type=int, default=512,
                       help="learning rate x global batch / N (DeiT: 512; 0: use --learning_rate as is)")
    sched.add_argument("--num_warmup_epochs", type=float, default=0.0, help="overrides --num_warmup_steps if > 0")
    add_training_arguments(parser, learning_rate=5e-4, weight_decay=0.05, lr_scheduler_type="cosine_with_min_lr",
                           min_learning_rate=1e-5, max_grad_norm=5.0, per_device_train_batch_size=64,
                           per_device_eval_batch_size=64, output_dir="runs/image_classification")
    return parser


#: PIL resampling codes (an image processor's `resample`) -> timm interpolation names
PIL_INTERPOLATION = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def fill_preprocessing(args) -> None:
    """Set the input pipeline's values left unset on the command line: from the checkpoint when fine-tuning (its
    config's image_size; its image processor's mean, std, crop_pct and filter, e.g. a converted timm model's), else
    DeiT's (224, ImageNet mean/std, crop 0.875, bicubic). A pretrained model must see its own normalisation."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    defaults = dict(image_size=224, image_mean=list(IMAGENET_DEFAULT_MEAN), image_std=list(IMAGENET_DEFAULT_STD),
                    eval_crop_pct=0.875, interpolation="bicubic")
    if all(getattr(args, name) is not None for name in defaults):  # filled already: nothing to read again
        return
    saved = {}
    if args.model_name_or_path:
        from transformers import AutoConfig, AutoImageProcessor

        saved["image_size"] = getattr(AutoConfig.from_pretrained(args.model_name_or_path), "image_size", None)
        try:
            processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
        except (OSError, ValueError):  # a checkpoint saved without an image processor: the defaults below
            processor = None
        if processor is not None:
            saved.update(image_mean=getattr(processor, "image_mean", None),
                         image_std=getattr(processor, "image_std", None),
                         eval_crop_pct=getattr(processor, "crop_pct", None),
                         interpolation=PIL_INTERPOLATION.get(int(getattr(processor, "resample", 3))))
    for name, default in defaults.items():
        if getattr(args, name) is None:
            value = saved.get(name)
            setattr(args, name, list(value) if isinstance(value, list | tuple) else value if value is not None
                    else default)


def check_arguments(args) -> None:
    check_training_arguments(args)
    fill_preprocessing(args)
    for name in ("reprob", "mixup_prob", "mixup_switch_prob", "label_smoothing", "drop_path_rate", "hflip"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a probability in [0, 1].")
    if args.mixup < 0 or args.cutmix < 0:
        raise ValueError("--mixup and --cutmix are Beta-distribution alphas: set 0 (off) or a positive value.")
    if (args.mixup or args.cutmix) and args.per_device_train_batch_size % 2:
        raise ValueError(f"Mixup/CutMix pair each image with the batch reversed, so --per_device_train_batch_size="
                         f"{args.per_device_train_batch_size} must be even (or set --mixup 0 --cutmix 0).")
    if not args.model_name_or_path and args.image_size % args.patch_size:  # a checkpoint brings its own
        raise ValueError(f"--patch_size={args.patch_size} must divide --image_size={args.image_size}.")
    if not 0.0 < args.crop_scale_min <= 1.0:
        raise ValueError(f"--crop_scale_min={args.crop_scale_min} is invalid: set an area share in (0, 1].")
    if not 0.0 < args.eval_crop_pct <= 1.0:
        raise ValueError(f"--eval_crop_pct={args.eval_crop_pct} is invalid: set a value in (0, 1].")


def _posterize_keeping_zero_bits(img, bits_to_keep, **kwargs):
    """timm's posterize, except that 0 bits gives a black image as Pillow < 12 did: RandAugment's
    PosterizeIncreasing reaches 0 bits when the sampled magnitude clips at 10 (m9, mstd 0.5), and Pillow 12+ raises
    "bits must be between or equal to 1 and 8" there, crashing about one batch in a few hundred."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep < 1:
        return img.point(lambda _: 0)
    from PIL import ImageOps

    return ImageOps.posterize(img, bits_to_keep)


def build_transforms(args):
    from timm.data import auto_augment, create_transform

    fill_preprocessing(args)
    for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
        auto_augment.NAME_TO_OP[name] = _posterize_keeping_zero_bits

    train = create_transform(args.image_size, is_training=True, scale=(args.crop_scale_min, 1.0), hflip=args.hflip,
                             auto_augment=args.auto_augment or None, color_jitter=args.color_jitter,
                             interpolation=args.interpolation, re_prob=args.reprob, re_mode="pixel", re_count=1,
                             mean=tuple(args.image_mean), std=tuple(args.image_std))
    evaluation = create_transform(args.image_size, is_training=False, interpolation=args.interpolation,
                                  crop_pct=args.eval_crop_pct, mean=tuple(args.image_mean), std=tuple(args.image_std))
    return train, evaluation


def build_mixup(args, num_labels: int):
    """timm's Mixup/CutMix (soft targets with label smoothing), or None when both are off."""
    if not (args.mixup or args.cutmix):
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, prob=args.mixup_prob,
                 switch_prob=args.mixup_switch_prob, mode="batch", label_smoothing=args.label_smoothing,
                 num_classes=num_labels)


def smoothed_one_hot(labels: torch.Tensor, num_labels: int, smoothing: float) -> torch.Tensor:
    """Soft targets for label smoothing without Mixup (the model's loss takes [batch, num_labels] targets)."""
    off = smoothing / num_labels
    return torch.full((labels.shape[0], num_labels), off, device=labels.device).scatter_(
        1, labels[:, None], 1.0 - smoothing + off)


def build_model(args, names: list[str]):
    if args.model_name_or_path:
        return AutoModelForImageClassification.from_pretrained(
            args.model_name_or_path, num_labels=len(names), id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)
    # The blocks see the patches and the class token; LSH attention sizes its default bucket count from this length.
    num_tokens = (args.image_size // args.patch_size) ** 2 + 1
    values = dict(image_size=args.image_size, patch_size=args.patch_size, num_channels=3, num_labels=len(names),
                  max_position_embeddings=num_tokens,
                  id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
                  drop_path_rate=args.drop_path_rate, layer_norm_eps=1e-6)
    return AutoModelForImageClassification.from_config(new_model_config(args.family, values, args.model))


def image_processor(args):
    """Saved beside the model so `AutoImageProcessor` reproduces the evaluation transform: resize the shorter side
    to size / crop_pct, centre-crop, normalise (timm's DeiT evaluation)."""
    from transformers import ConvNextImageProcessor

    fill_preprocessing(args)  # a no-op once check_arguments has filled them
    resample = {name: code for code, name in PIL_INTERPOLATION.items()}.get(args.interpolation, 3)
    return ConvNextImageProcessor(size={"shortest_edge": args.image_size}, crop_pct=args.eval_crop_pct,
                                  resample=resample, image_mean=list(args.image_mean),
                                  image_std=list(args.image_std))


def main(argv=None):
    args = parse_with_recipe(build_parser(), argv)
    check_arguments(args)
    accelerator = build_accelerator(args, "train_image_classification")
    set_seed(args.seed)
    with accelerator.main_process_first():
        raw, names = load_labelled_images(args)
    train_set, validation_set = image_sets(args, raw)
    model = build_model(args, names)
    global_batch = scale_learning_rate(args, accelerator)
    validation_loader = eval_loader(validation_set, args.per_device_eval_batch_size, accelerator, collate_images)
    run = prepare_run(accelerator, args, model, train_loader(train_set, args.per_device_train_batch_size, args.seed,
                                                             collate_fn=collate_images), "train_image_classification",
                      optimizer=build_optimizer(model, args, no_decay_name_parts=VISION_NO_DECAY))
    accelerator.print(f"{run.num_parameters / 1e6:.2f}M parameters, {len(names)} classes, {len(train_set)} training "
                      f"images, global batch {global_batch}, lr {args.learning_rate:.3g}, {run.max_steps} steps, "
                      f"{accelerator.num_processes} process(es)")
    step = train(accelerator, args, run, build_mixup(args, len(names)), len(names), validation_loader)
    accuracy = evaluate_top1(run.model, validation_loader, accelerator, args.max_eval_batches)
    results = {"eval_accuracy": accuracy, "eval_split": "validation", "num_eval_images": len(validation_set),
               "train_steps": step, "num_labels": len(names), "num_parameters": run.num_parameters,
               "learning_rate": args.learning_rate, "global_batch_size": global_batch,
               "train_seconds": run.guard.training_seconds(), "num_processes": accelerator.num_processes}
    accelerator.log({"eval_accuracy": accuracy}, step=step)
    unwrapped = save_final_model(accelerator, run.model, args.output_dir, tokenizer=image_processor(args))
    results["family"] = unwrapped.config.model_type.removeprefix("attnzoo_")
    accelerator.print(f"validation top-1 accuracy {accuracy:.4f}; model saved to {args.output_dir}")
    publish_run(accelerator, args, results, lambda: image_card(args, unwrapped, results), title=str(args.output_dir))
    accelerator.end_training()
    return accuracy


def image_sets(args, raw):
    """The training images (augmented) and the validation images (resized and cropped), decoded as they are read."""
    train_transform, eval_transform = build_transforms(args)
    train_set = with_transform(raw["train"], train_transform, args.image_column, args.label_column, args.seed,
                               skip_bad=args.skip_bad_examples)
    validation_set = with_transform(raw["validation"], eval_transform, args.image_column, args.label_column,
                                    skip_bad=args.skip_bad_examples)
    return train_set, validation_set


def scale_learning_rate(args, accelerator) -> int:
    """DeiT's linear scaling rule (--lr_scaling_batch): the learning rates scaled by the global batch; returns it."""
    global_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    if args.lr_scaling_batch:
        args.learning_rate = args.learning_rate * global_batch / args.lr_scaling_batch
        args.min_learning_rate = args.min_learning_rate * global_batch / args.lr_scaling_batch
    return global_batch


def train(accelerator, args, run, mixup, num_labels: int, validation_loader) -> int:
    """The training loop from the run's start step (Mixup/CutMix or label smoothing); the last step."""
    model, step = run.model, run.start_step
    progress = progress_bar(accelerator, run.max_steps, step)
    train_loss = RunningMean()
    started = run.guard.start_clock()
    model.train()
    for batch in run.guard.watch(train_batches(accelerator, run.loader, step)) if step < run.max_steps else ():
        pixels, labels = batch["pixel_values"], batch["labels"]
        if mixup is not None:
            pixels, targets = mixup(pixels, labels)
        else:
            targets = smoothed_one_hot(labels, num_labels, args.label_smoothing)
        loss = training_step(accelerator, model, run.optimizer, run.scheduler, args.max_grad_norm,
                             lambda x=pixels, y=targets: model(pixel_values=x, labels=y).loss, run.guard)
        train_loss.add(loss)
        if not accelerator.sync_gradients:
            continue
        step += 1
        progress.update(1)
        record = training_record(accelerator, args, step, run.max_steps, train_loss, run.scheduler, started, progress)
        if args.eval_steps and step % args.eval_steps == 0:
            record["eval_accuracy"] = evaluate_top1(model, validation_loader, accelerator, args.max_eval_batches)
        log_and_checkpoint(accelerator, args, Path(args.output_dir), step, record, run.guard)
        if step >= run.max_steps:
            break
    progress.close()
    return step


def image_card(args, model, results: dict):
    dataset_name = args.dataset_name or Path(args.train_dir).parent.name
    return build_model_card(
        "image_classification", args=args, config=model.config, num_parameters=results["num_parameters"],
        results=results, eval_results=[top1_result(results["eval_accuracy"], dataset_name,
                                                   args.dataset_name or "imagefolder", "validation")],
        pipeline_tag="image-classification", datasets=[args.dataset_name] if args.dataset_name else None,
        dataset_name=dataset_name, num_labels=results["num_labels"], image_size=args.image_size,
        pooling=model.config.pooling, auto_augment=args.auto_augment or "off", mixup=args.mixup,
        cutmix=args.cutmix, label_smoothing=args.label_smoothing, reprob=args.reprob,
        drop_path=model.config.drop_path_rate, weight_decay=args.weight_decay, eval_split="validation",
        resize=round(args.image_size / args.eval_crop_pct))


if __name__ == "__main__":
    main()
