"""Seed 002 Figure 1: how well Performer, LARA and RA approximate the softmax attention of a trained model.

    python benchmarks/approximation_quality.py --device cuda
    python benchmarks/approximation_quality.py --device cpu --epochs 3 --images 32

Protocol (spec §6.4), at a scale that needs no download: a softmax ViT (4 layers, hidden 192, 3 heads of 64, mean
pooling) is trained here on scikit-learn's handwritten digits, upscaled from 8x8 to 56x56 and cut into 4x4 patches,
i.e. the paper's 14x14 = 196-token grid. At every attention block, each approximation gets the softmax model's own
q, k, v (after its LayerNorm and projections) for held-out images; the MSE of its output against the exact softmax
output is averaged over heads, layers, images and `--draws` random draws, for sample counts 4-196:
- Performer: m orthogonal positive random features (redrawn per draw).
- LARA: m proposals with parameter-free 2-D pooled landmarks (a softmax model has no landmark Linear+LayerNorm),
  Eq. 35 means and Eq. 38 weights with λ = 2 (the paper's vision settings); "sampling" draws ω with the official
  noise scale, "evaluation" plugs in ω = μ.
- RA: the average of m draws from the exact mixture p_n (σ = 1, unbiased).
The script reports whether the paper's ordering (RA < LARA < Performer, LARA improving as samples grow) holds here,
whatever the answer. Results: benchmarks/results/approximation_quality.json and .png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import attnzoo  # noqa: F401
from attnzoo import ZooLARAConfig, ZooSoftmaxConfig, ZooSoftmaxForImageClassification
from attnzoo.modeling.attention import LinearRandomizedAttention, SoftmaxAttention, softmax_attention_reference
from attnzoo.modeling.attention.random_features import (
    gaussian_projection,
    linear_attention_bidirectional,
    log_positive_features,
    snis_attention,
    stabilised_key_features,
    stabilised_query_features,
)
from attnzoo.modeling.attention.randomized import randomized_aggregate, sample_omega

RESULTS = Path(__file__).parent / "results"
SAMPLES = [4, 9, 16, 25, 49, 100, 196]
HEADS, HEAD_DIM = 3, 64


def digits(device):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = torch.nn.functional.interpolate(images, size=56, mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(data.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=g)
    train, test = order[:1500], order[1500:]
    return images[train].to(device), labels[train].to(device), images[test].to(device), labels[test].to(device)


def train_vit(device, epochs: int):
    x_train, y_train, x_test, y_test = digits(device)
    config = ZooSoftmaxConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_hidden_layers=4,
                              intermediate_size=768, image_size=56, patch_size=4, num_channels=1, pooling="mean",
                              num_labels=10, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = ZooSoftmaxForImageClassification(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    steps = epochs * (len(y_train) // 50)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(epochs):
        for batch in torch.randperm(len(y_train), generator=g).split(50)[: len(y_train) // 50]:
            loss = model(pixel_values=x_train[batch], labels=y_train[batch]).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        accuracy = (model(pixel_values=x_test).logits.argmax(-1) == y_test).float().mean().item()
    return model, x_test, accuracy


@torch.no_grad()
def capture_qkv(model, images):
    """Per attention block: the q, k, v [B, H, N, d] the softmax model computed for `images`."""
    captured = []
    blocks = model.model.transformer.blocks
    inputs = {}
    handles = [block.attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i, block in enumerate(blocks)]
    model(pixel_values=images)
    for handle in handles:
        handle.remove()
    for i, block in enumerate(blocks):
        attn: SoftmaxAttention = block.attn
        q, k, v = (attn.split_heads(p(inputs[i])) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        captured.append((q.double(), k.double(), v.double()))
    return captured


def performer_output(q, k, v, m):
    projection = gaussian_projection((HEADS, m), HEAD_DIM, orthogonal=True, device=q.device, dtype=q.dtype)
    phi_k, _ = stabilised_key_features(log_positive_features(k, projection), None)
    return linear_attention_bidirectional(stabilised_query_features(log_positive_features(q, projection)), phi_k, v)


def lara_module(m, device, training: bool):
    config = ZooLARAConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, lara_num_samples=m,
                           lara_landmarks="2d", lara_proposal_mean="q+mixed_k", lara_landmark_transform=False,
                           lara_alpha_coeff=2.0, sample_noise_std="official")
    return LinearRandomizedAttention(config, 0, causal=False).to(device).double().train(training)


def ra_output(q, k, v, m):
    scale = HEAD_DIM ** -0.25
    q_hat, k_hat = q * scale, k * scale
    chunks = [randomized_aggregate(sample_omega(qc, k_hat, None, "unbiased", m, 1.0), k_hat, v, None)
              for qc in q_hat.split(max(1, 4096 // m), dim=2)]  # bounded [N, S, M] working memory
    return torch.cat(chunks, dim=2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--images", type=int, default=64, help="held-out images whose attention is approximated")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--samples", type=int, nargs="+", default=SAMPLES)
    args = p.parse_args()
    model, x_test, accuracy = train_vit(args.device, args.epochs)
    print(f"softmax ViT held-out accuracy: {accuracy:.3f}")
    layers = capture_qkv(model, x_test[: args.images])
    methods = ["performer", "lara (sampling)", "lara (evaluation, w = mu)", "ra"]
    mse = {name: {} for name in methods}
    torch.manual_seed(0)
    for m in args.samples:
        totals = dict.fromkeys(methods, 0.0)
        for q, k, v in layers:
            exact = softmax_attention_reference(q, k, v)
            for draw in range(args.draws):
                outputs = {"performer": performer_output(q, k, v, m), "ra": ra_output(q, k, v, m)}
                for name, training in (("lara (sampling)", True), ("lara (evaluation, w = mu)", False)):
                    if training or draw == 0:
                        outputs[name] = snis_attention(*lara_module(m, q.device, training).bidirectional_terms(
                            q, k, v, None, (14, 14)))
                for name, out in outputs.items():
                    weight = 1 if name != "lara (evaluation, w = mu)" else args.draws
                    totals[name] += weight * ((out - exact) ** 2).mean().item()
        for name in methods:
            mse[name][m] = totals[name] / (len(layers) * args.draws)
        print(f"samples {m:4d}: " + ", ".join(f"{n} {mse[n][m]:.3e}" for n in methods))

    findings = {
        "ra_below_lara_at_every_count": all(mse["ra"][m] < mse["lara (sampling)"][m] for m in args.samples),
        "lara_below_performer_at_every_count": all(mse["lara (sampling)"][m] < mse["performer"][m]
                                                   for m in args.samples),
        "lara_keeps_improving": all(mse["lara (sampling)"][a] > mse["lara (sampling)"][b]
                                    for a, b in zip(args.samples, args.samples[1:], strict=False)),
    }
    print(json.dumps(findings, indent=2))
    result = {"setup": {"device": args.device, "vit_test_accuracy": accuracy, "images": args.images,
                        "draws": args.draws, "tokens": 196, "heads": HEADS, "head_dim": HEAD_DIM, "layers": 4},
              "mse": {name: {str(m): value for m, value in values.items()} for name, values in mse.items()},
              "findings": findings}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "approximation_quality.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (name, values), style in zip(result["mse"].items(), ("s--", "o-", "o:", "^-"), strict=True):
        counts = sorted(int(m) for m in values)
        ax.plot(counts, [values[str(m)] for m in counts], style, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("samples (random features / proposals / draws)")
    ax.set_ylabel("MSE against exact softmax attention")
    s = result["setup"]
    ax.set_title(f"Attention approximation on a trained softmax ViT (digits, 196 tokens, acc "
                 f"{s['vit_test_accuracy']:.2f})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
