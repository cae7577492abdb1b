"""Fidelity of the attention swap: how far a converted model's outputs are from its softmax source, before any
fine-tuning, as each family's approximation gets finer (more random features, samples, proposals or hash rounds).

    nice -n 5 python benchmarks/conversion_fidelity.py      # ~30 min on 2 busy cores, most of it training the ViT

Sources (trained here, no download):
- a byte-level GPT-2 (transformers' GPT2LMHeadModel): benchmarks/uptraining.py's source (`--gpt2`, default
  runs/uptraining/source; trained with that script's defaults when missing), measured on 256-byte blocks of its
  held-out text;
- a timm ViT (vit_tiny_patch16_224's block at 32x32 pixels, patch 4: 64 patches + a class token; 4 layers x 96)
  trained here for `--vit_epochs` epochs (AdamW, one-cycle schedule, no augmentation) on 6,000 rendered digits
  (scripts/prepare_glyph_images.py --train_per_class 600), measured on 200 images of their validation split; saved
  to `--vit_dir` and reused.
Each is converted with attnzoo.convert.gpt2 / attnzoo.convert.vit. The error is KL(source || converted) of the
output distributions (next byte; class), in nats per prediction; with the held-out bits/dim (GPT-2) and the top-1
agreement with the source (ViT). Knobs: Performer num_random_features; RA ra_num_samples; LARA lara_num_samples
(ViT; 65 = one landmark per token) or, for causal LARA, the number of proposals over a 256-byte block (one per
`lara_chunk_size` chunk, plus the prior); Reformer lsh_num_hashes with every layer LSH. LSH shares queries and keys,
so its limit is full shared-QK attention, not the source: that floor is measured too (`lsh_full_attention_threshold`
>= length). Random parts (features, samples, hashes) are averaged over `--seeds` seeds.
Writes benchmarks/results/conversion_fidelity.json and .png (`--results`), replaced only by a report of the same setup
(another setup's goes beside it; a file that is not this benchmark's report is refused: benchmarks/owned_outputs.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/conversion_fidelity"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = require_keys("gpt2", "vit", "seeds", benchmark="conversion_fidelity")
BLOCK = 256

GPT2_SWEEPS = {
    "performer": ("num_random_features", [16, 32, 64, 128, 256, 512], {}),
    "ra": ("ra_num_samples", [1, 2, 4, 8, 16], {}),
    "lara": ("lara_chunk_size", [128, 64, 32, 16, 8, 4], {}),
    "reformer": ("lsh_num_hashes", [1, 2, 4, 8], {"attn_layers": ["lsh"], "lsh_chunk_length": 32}),
}
VIT_SWEEPS = {
    "performer": ("num_random_features", [16, 32, 64, 128, 256, 512], {}),
    "ra": ("ra_num_samples", [1, 2, 4, 8, 16], {}),
    "lara": ("lara_num_samples", [4, 8, 16, 32, 65], {}),
    "reformer": ("lsh_num_hashes", [1, 2, 4, 8], {"attn_layers": ["lsh"], "lsh_chunk_length": 8}),
}
#: families whose converted evaluation is deterministic (no seeds to average over)
DETERMINISTIC = {"lara"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt2", type=Path, default=Path("runs/uptraining/source"))
    p.add_argument("--gpt2_blocks", type=int, default=24, help="held-out 256-byte blocks to measure on")
    p.add_argument("--glyphs", type=Path, default=Path("data/glyphs_fidelity"),
                   help="rendered digits, 600 training images per class (made here when missing)")
    p.add_argument("--vit_dir", type=Path, default=Path("runs/conversion_fidelity/vit"))
    p.add_argument("--vit_epochs", type=int, default=12)
    p.add_argument("--vit_learning_rate", type=float, default=2e-3)
    p.add_argument("--vit_images", type=int, default=200, help="validation images to measure on")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--results", type=Path, default=RESULTS / "conversion_fidelity.json")
    return p


# -- sources ----------------------------------------------------------------------------------------------------
def gpt2_source(folder: Path):
    from transformers import GPT2LMHeadModel

    if not (folder / "model.safetensors").is_file():
        print(f"no GPT-2 source in {folder}: training one with benchmarks/uptraining.py's defaults", flush=True)
        sys.path.insert(0, str(Path(__file__).parent))
        import uptraining

        args = uptraining.build_parser().parse_args(["--output_dir", str(folder.parent)])
        uptraining.save_gpt2_source_init(folder.parent / "source_init", args)
        uptraining.train(folder.parent / "source_init", folder, args.source_steps, args, [],
                         learning_rate=args.source_learning_rate)
    return GPT2LMHeadModel.from_pretrained(folder).eval()


def heldout_blocks(count: int) -> torch.Tensor:
    """The first `count` 256-byte blocks of train_lm.py's held-out split of the default corpus."""
    from attnzoo.training.text_data import TokenBlocks, read_bytes, split_bytes

    _, heldout = split_bytes(read_bytes(None), 0.05)  # None: the default corpus
    blocks = TokenBlocks(heldout, BLOCK)
    return torch.stack([blocks[i]["input_ids"] for i in range(min(count, len(blocks)))]).long()


def glyph_loaders(folder: Path, data_config: dict, images: int):
    from torch.utils.data import DataLoader, Subset
    from torchvision import datasets, transforms

    if not (folder / "train").is_dir():
        subprocess.run([sys.executable, "scripts/prepare_glyph_images.py", "--output_dir", str(folder),
                        "--train_per_class", "600"], cwd=ROOT, check=True)
    transform = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize(data_config["mean"], data_config["std"])])
    train = datasets.ImageFolder(folder / "train", transform)
    validation = datasets.ImageFolder(folder / "validation", transform)
    picked = torch.randperm(len(validation), generator=torch.Generator().manual_seed(0))[:images].tolist()
    return (DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)),
            DataLoader(Subset(validation, picked), batch_size=100))


def vit_source(args):
    """A timm ViT trained on rendered digits (plain AdamW, no augmentation), saved in timm's format."""
    import timm
    from timm.models import _hub

    kwargs = dict(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, num_classes=10)
    folder = args.vit_dir
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs)
    data_config = timm.data.resolve_data_config({}, model=model)
    train, validation = glyph_loaders(args.glyphs, data_config, args.vit_images)
    if (folder / "config.json").is_file():
        model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.vit_learning_rate, weight_decay=0.05)
        steps = args.vit_epochs * len(train)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.vit_learning_rate, total_steps=steps,
                                                       pct_start=0.1)
        model.train()
        for _ in range(args.vit_epochs):
            for x, y in train:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        folder.mkdir(parents=True, exist_ok=True)
        _hub.save_for_hf(model, str(folder))
    x, y = map(torch.cat, zip(*list(validation), strict=True))
    model.eval()
    with torch.no_grad():
        print(f"ViT source: top-1 {(model(x).argmax(-1) == y).double().mean().item():.3f} on {len(y)} validation "
              "images", flush=True)
    return model, x, y


# -- measurements -----------------------------------------------------------------------------------------------
def kl_and_nll(reference_logits, logits, targets=None) -> dict:
    reference, log_probs = reference_logits.log_softmax(-1), logits.log_softmax(-1)
    out = {"kl_nats": (reference.exp() * (reference - log_probs)).sum(-1).mean().item()}
    if targets is not None:
        out["nll_nats"] = -log_probs.gather(-1, targets[..., None]).mean().item()
    return out


def measure(convert, source_logits, forward, family: str, field: str, values: list, fixed: dict, seeds: int,
            extra_metrics) -> list[dict]:
    points = []
    for value in values:
        runs = []
        for seed in range(1 if family in DETERMINISTIC else seeds):
            model = convert(family, {field: value, **fixed}, seed).eval()
            torch.manual_seed(100 + seed)
            with torch.no_grad():
                runs.append(extra_metrics(source_logits, forward(model)))
        point = {field: value, **{k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}, "seeds": len(runs)}
        points.append(point)
        print(f"  {family} {field}={value}: " + ", ".join(f"{k} {v:.4g}" for k, v in point.items()
                                                           if isinstance(v, float)), flush=True)
    return points


def gpt2_fidelity(args) -> dict:
    from attnzoo.convert import gpt2

    source = gpt2_source(args.gpt2)
    ids = heldout_blocks(args.gpt2_blocks)
    targets = ids[:, 1:]
    with torch.no_grad():
        source_logits = source(ids).logits[:, :-1]

    def forward(model):  # a few blocks at a time: RA's samples multiply its [queries, keys] scores
        return torch.cat([model(part).logits[:, :-1] for part in ids.split(4)])

    def metrics(reference, logits):
        found = kl_and_nll(reference, logits, targets)
        found["bits_per_dim"] = found.pop("nll_nats") / torch.log(torch.tensor(2.0)).item()
        return found

    def convert(family, overrides, seed):
        return gpt2.convert(source, family, overrides, seed=seed)

    source_bpd = kl_and_nll(source_logits, source_logits, targets)["nll_nats"] / torch.log(torch.tensor(2.0)).item()
    result = {"source": str(args.gpt2), "blocks": ids.shape[0], "block_size": BLOCK,
              "source_bits_per_dim": source_bpd, "sweeps": {}}
    for family, (field, values, fixed) in GPT2_SWEEPS.items():
        points = measure(convert, source_logits, forward, family, field, values, fixed, args.seeds, metrics)
        if family == "lara":  # causal LARA: one proposal per completed chunk plus the prior
            for point in points:
                point["proposals"] = BLOCK // point[field] + 1
        result["sweeps"][family] = {"knob": field, "fixed": fixed, "points": points}
    floor = {**GPT2_SWEEPS["reformer"][2], "lsh_full_attention_threshold": BLOCK}
    result["shared_qk_full_attention"] = measure(convert, source_logits, forward, "reformer", "lsh_num_hashes", [1],
                                                 floor, 1, metrics)[0]
    return result


def vit_fidelity(args) -> dict:
    from attnzoo.convert import vit

    source, x, labels = vit_source(args)
    with torch.no_grad():
        source_logits = source(x)

    def forward(model):
        return torch.cat([model(pixel_values=part).logits for part in x.split(50)])

    def metrics(reference, logits):
        found = kl_and_nll(reference, logits)
        found["top1_agreement"] = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
        found["top1_accuracy"] = (logits.argmax(-1) == labels).double().mean().item()
        return found

    def convert(family, overrides, seed):
        return vit.convert(source, family, overrides, seed=seed)

    tokens = (32 // 4) ** 2 + 1
    result = {"source": str(args.vit_dir), "images": x.shape[0], "tokens": tokens,
              "source_top1_accuracy": (source_logits.argmax(-1) == labels).double().mean().item(), "sweeps": {}}
    for family, (field, values, fixed) in VIT_SWEEPS.items():
        points = measure(convert, source_logits, forward, family, field, values, fixed, args.seeds, metrics)
        result["sweeps"][family] = {"knob": field, "fixed": fixed, "points": points}
    floor = {**VIT_SWEEPS["reformer"][2], "lsh_full_attention_threshold": tokens}
    result["shared_qk_full_attention"] = measure(convert, source_logits, forward, "reformer", "lsh_num_hashes", [1],
                                                 floor, 1, metrics)[0]
    return result


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    setup = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "results"},
             "gpt2_sweeps": GPT2_SWEEPS, "vit_sweeps": VIT_SWEEPS}
    # decided before measuring (and before training a missing source): a file that is not this benchmark's report is
    # refused with nothing run
    target = report_target(args.results, setup, REPORT_CHECK, f"{SCRIPT}.py")
    started = time.time()
    print("GPT-2 (byte-level, causal):", flush=True)
    gpt2_result = gpt2_fidelity(args)
    print("ViT (rendered digits):", flush=True)
    vit_result = vit_fidelity(args)
    report = {"benchmark": "conversion_fidelity", "setup": setup, "gpt2": gpt2_result, "vit": vit_result,
              "seeds": args.seeds,
              "command": "python benchmarks/conversion_fidelity.py " + " ".join(argv or sys.argv[1:]),
              "wall_seconds": round(time.time() - started, 1)}
    write_report(target, report, indent=2)
    plot(report, target.with_suffix(".png"))
    print(f"wrote {target} and {target.with_suffix('.png')}")
    return report


def knob_axis(family: str, sweep: dict) -> tuple[list, str]:
    if "proposals" in sweep["points"][0]:
        return [p["proposals"] for p in sweep["points"]], "proposals"
    return [p[sweep["knob"]] for p in sweep["points"]], sweep["knob"]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    titles = {"gpt2": f"GPT-2 -> family (held-out text, source {report['gpt2']['source_bits_per_dim']:.3f} bits/dim)",
              "vit": f"ViT -> family (digits, source top-1 {report['vit']['source_top1_accuracy']:.3f})"}
    colours = dict(zip(GPT2_SWEEPS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, name in zip(axes, ("gpt2", "vit"), strict=True):
        result = report[name]
        for family, sweep in result["sweeps"].items():
            xs, label = knob_axis(family, sweep)
            ax.plot(xs, [p["kl_nats"] for p in sweep["points"]], "o-", color=colours[family],
                    label=f"{family} ({label})")
        ax.axhline(result["shared_qk_full_attention"]["kl_nats"], color=colours["reformer"], ls="--", lw=1,
                   label="reformer limit: full shared-QK attention")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("features / samples / proposals / hash rounds")
        ax.set_ylabel("KL(source || converted), nats per prediction")
        ax.set_title(titles[name], fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
