"""Figure 1 of "Linear Complexity Randomized Self-attention Mechanism" (arXiv 2204.04667, §5.1): how well Performer,
LARA and RA approximate softmax attention, and why the ordering found here differs from the paper's.

    python benchmarks/approximation_quality.py                 # the full run: ~12 minutes on 2 CPU cores
    python benchmarks/approximation_quality.py --device cuda
    python benchmarks/approximation_quality.py --quick --output /tmp/aq.json   # smoke test, seconds

Inputs ("sources"), each a set of per-head q, k, v with 196 tokens (a 14x14 grid), head dim 64, 3 heads:
- vit: a softmax ViT (4 layers, hidden 192, mean pooling) trained here on scikit-learn's handwritten digits,
  upscaled from 8x8 to 56x56 and cut into 4x4 patches (the paper's 14x14 = 196-token grid; no download). At every
  attention block the approximations get the model's own q, k, v for held-out images.
- iid: q, k, v with i.i.d. N(0, 1) entries (no structure: a query's own key is no more similar than any other).
- clustered: 8 cluster centres per sequence; each token's q and k are its centre plus independent noise (std 0.5),
  positions random; attention concentrates on a query's cluster.

Estimators, at sample counts 4-196 (perfect squares, as 2-D landmarks need), each redrawn `--draws` times:
- performer: the zoo's positive orthogonal random features (no ε: only the self-normalisation bias).
- performer_paper_code: the same features with the official code's +1e-4 per feature and denominator ≥ 1e-2.
- lara_official_sigma / lara_paper_sigma: sampling-mode LARA (parameter-free 2-D landmarks, Eq. 35 means, Eq. 38
  weights, λ = 2) with noise σ = d^-1/4 (`sample_noise_std="official"`) or σ = 1 (`"paper"`); the importance
  weights use unit-covariance proposal densities either way, so only σ = 1 is consistent.
- lara_evaluation: ω = μ (what a trained LARA model computes at evaluation, for either σ).
- ra: unbiased RA, the mean of m exact draws per query.
For each: MSE against exact softmax attention (averaged over heads, layers, images and draws), the mean effective
sample size 1/Σ w² of each query's sample weights, and the mean weight of each query's own position in the implied
attention matrix ("self weight"; softmax's own is reported beside it). A consistency run holds LARA at 16 proposals
and raises the samples drawn per proposal (1-49) for both σ. Results: benchmarks/results/approximation_quality.json
and .png (`--output`), replaced only by a report of the same setup (another setup's goes beside it; a file that is not
this benchmark's report is refused: benchmarks/owned_outputs.py); the results page benchmarks/approximation_quality.md
explains them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import approximation_estimators as est  # noqa: E402
from owned_outputs import exit_on_refusal, report_target, require_keys, write_report  # noqa: E402

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForImageClassification  # noqa: E402
from attnzoo.modeling.attention import SoftmaxAttention, softmax_attention_reference  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SCRIPT = "benchmarks/approximation_quality"
#: what makes a results file this benchmark's report (the committed one, from before reports were marked, too)
REPORT_CHECK = require_keys("setup", "labels", "sources", benchmark="approximation_quality")
SOURCES = ("vit", "iid", "clustered")
SAMPLES = [4, 9, 16, 25, 49, 100, 196]
CONSISTENCY_PROPOSALS = 16
PER_PROPOSAL = [1, 4, 16, 49]
HEADS, HEAD_DIM, GRID = 3, 64, (14, 14)
TOKENS = GRID[0] * GRID[1]
NOISE = {"lara_official_sigma": "official", "lara_paper_sigma": "paper"}
METHODS = ("performer", "performer_paper_code", "lara_official_sigma", "lara_paper_sigma", "lara_evaluation", "ra")
LABELS = {"performer": "Performer (zoo, unbiased features)",
          "performer_paper_code": "Performer (paper code: +1e-4, denom >= 1e-2)",
          "lara_official_sigma": "LARA sampling, sigma = d^-1/4 (official)",
          "lara_paper_sigma": "LARA sampling, sigma = 1 (paper)",
          "lara_evaluation": "LARA evaluation (omega = mu)",
          "ra": "RA (unbiased)"}
STYLES = {"performer": ("s-", "tab:blue"), "performer_paper_code": ("s--", "tab:orange"),
          "lara_official_sigma": ("o-", "tab:green"), "lara_paper_sigma": ("D-", "tab:red"),
          "lara_evaluation": ("o:", "tab:purple"), "ra": ("^-", "tab:brown")}
CLUSTERS, CLUSTER_NOISE = 8, 0.5


# -- sources -------------------------------------------------------------------------------------------------
def digits(device, train_images: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError("the 'vit' source trains on scikit-learn's digits: pip install scikit-learn (it is in "
                          "the project's dev extra), or leave 'vit' out of --sources.") from error
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = torch.nn.functional.interpolate(images, size=56, mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(data.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=g)
    train, test = order[:train_images], order[1500:]
    return images[train].to(device), labels[train].to(device), images[test].to(device), labels[test].to(device)


def train_vit(device, epochs: int, train_images: int = 1500):
    x_train, y_train, x_test, y_test = digits(device, train_images)
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
    """Per attention block: the q, k, v [B, H, N, d] the softmax model computed for `images`, in float64."""
    blocks = model.model.transformer.blocks
    inputs = {}
    handles = [block.attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i, block in enumerate(blocks)]
    model(pixel_values=images)
    for handle in handles:
        handle.remove()
    captured = []
    for i, block in enumerate(blocks):
        attn: SoftmaxAttention = block.attn
        q, k, v = (attn.split_heads(p(inputs[i])) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        captured.append((q.double(), k.double(), v.double()))
    return captured


def synthetic_qkv(kind: str, batch: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [batch, HEADS, TOKENS, HEAD_DIM] in float64: "iid" (N(0, 1) entries) or "clustered"."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, TOKENS, HEAD_DIM)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "iid":
        q, k = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g,
                                                                                dtype=torch.float64)
    elif kind == "clustered":
        centres = torch.randn(batch, HEADS, CLUSTERS, HEAD_DIM, generator=g, dtype=torch.float64)
        member = torch.randint(CLUSTERS, (batch, HEADS, TOKENS), generator=g)
        own = torch.gather(centres, 2, member.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM))
        q = own + CLUSTER_NOISE * torch.randn(shape, generator=g, dtype=torch.float64)
        k = own + CLUSTER_NOISE * torch.randn(shape, generator=g, dtype=torch.float64)
    else:
        raise ValueError(f"unknown synthetic source {kind!r}: use 'iid' or 'clustered'.")
    return q.to(device), k.to(device), v.to(device)


# -- measurements ----------------------------------------------------------------------------------------------
class Tally:
    """Running means of MSE, effective sample size and self weight per (method, sample count)."""

    def __init__(self):
        self.sums: dict[tuple[str, int], dict[str, float]] = {}

    def add(self, method: str, count: int, approx: est.Approximation, exact: torch.Tensor, weight: int = 1):
        cell = self.sums.setdefault((method, count), {"mse": 0.0, "ess": 0.0, "self_weight": 0.0, "n": 0})
        cell["mse"] += weight * ((approx.output - exact) ** 2).mean().item()
        cell["ess"] += weight * approx.effective_sample_size().mean().item()
        cell["self_weight"] += weight * approx.self_weight.mean().item()
        if approx.row_mass is not None:
            cell["row_mass"] = cell.get("row_mass", 0.0) + weight * approx.row_mass.mean().item()
        cell["n"] += weight

    def table(self, methods, counts) -> dict:
        out = {}
        for method in methods:
            cells = {m: self.sums[(method, m)] for m in counts if (method, m) in self.sums}
            metrics = [name for name in ("mse", "ess", "self_weight", "row_mass") if name in cells[counts[0]]]
            out[method] = {metric: {str(m): cell[metric] / cell["n"] for m, cell in cells.items()}
                           for metric in metrics}
        return out


def measure_counts(blocks, samples, draws: int) -> dict:
    """MSE, ESS and self weight of every method at every sample count (proposals = features = RA draws)."""
    tally = Tally()
    for q, k, v in blocks:
        exact = softmax_attention_reference(q, k, v)
        for m in samples:
            for draw in range(draws):
                projection = est.performer_projection(HEADS, m, HEAD_DIM, q.device, q.dtype)
                tally.add("performer", m, est.performer(q, k, v, projection), exact)
                tally.add("performer_paper_code", m, est.paper_code_performer(q, k, v, projection), exact)
                for name, noise in NOISE.items():
                    module = est.lara_module(HEADS, HEAD_DIM, m, 1, noise, True, q.device, q.dtype)
                    tally.add(name, m, est.lara(module, q, k, v, GRID), exact)
                if draw == 0:  # deterministic: one evaluation, counted as `draws` for equal weighting
                    module = est.lara_module(HEADS, HEAD_DIM, m, 1, "official", False, q.device, q.dtype)
                    tally.add("lara_evaluation", m, est.lara(module, q, k, v, GRID), exact, weight=draws)
            # RA's draws are independent per query, so one draw already averages thousands of them.
            tally.add("ra", m, est.ra(q, k, v, m), exact)
    return tally.table(METHODS, samples)


def measure_consistency(blocks, per_proposal, draws: int) -> dict:
    """LARA at a fixed number of proposals, with more samples drawn from each: the consistency check."""
    tally = Tally()
    for q, k, v in blocks:
        exact = softmax_attention_reference(q, k, v)
        for per in per_proposal:
            for _ in range(draws):
                for name, noise in NOISE.items():
                    module = est.lara_module(HEADS, HEAD_DIM, CONSISTENCY_PROPOSALS, per, noise, True, q.device,
                                             q.dtype)
                    tally.add(name, per, est.lara(module, q, k, v, GRID), exact)
    return tally.table(NOISE, per_proposal)


def softmax_self_weight(blocks) -> float:
    return sum(est.softmax_self_weight(q, k).mean().item() for q, k, _ in blocks) / len(blocks)


def reference_errors(blocks) -> dict:
    """MSE of two estimators that ignore q and k: a zero output, and uniform attention (every query gets the
    mean value). An approximation near these has learned nothing about the attention pattern."""
    zero = uniform = 0.0
    for q, k, v in blocks:
        exact = softmax_attention_reference(q, k, v)
        zero += (exact**2).mean().item()
        uniform += ((v.mean(2, keepdim=True) - exact) ** 2).mean().item()
    return {"zero_output": zero / len(blocks), "uniform_attention": uniform / len(blocks)}


def findings(source: dict, samples, per_proposal) -> dict:
    """What the numbers say, computed from them: orderings, improvement with samples, consistency."""
    mse = {name: values["mse"] for name, values in source["methods"].items()}
    compared = ("ra", "performer", "performer_paper_code", "lara_official_sigma", "lara_paper_sigma",
                "lara_evaluation")
    lo, hi = str(samples[0]), str(samples[-1])

    def paper_ordering(lara_name, performer_name):
        return [m for m in samples if mse["ra"][str(m)] < mse[lara_name][str(m)] < mse[performer_name][str(m)]]

    consistency = source["consistency"]
    first, last = str(per_proposal[0]), str(per_proposal[-1])
    return {
        "ordering_by_mse": {str(m): " < ".join(sorted(compared, key=lambda n: mse[n][str(m)])) for m in samples},
        "counts_where_ra_lara_performer_holds": {
            f"{lara_name} vs {performer_name}": paper_ordering(lara_name, performer_name)
            for lara_name in ("lara_official_sigma", "lara_paper_sigma", "lara_evaluation")
            for performer_name in ("performer", "performer_paper_code")},
        f"mse_ratio_{hi}_to_{lo}_samples": {name: mse[name][hi] / mse[name][lo] for name in compared},
        f"consistency_mse_ratio_{last}_to_{first}_per_proposal": {
            name: consistency[name]["mse"][last] / consistency[name]["mse"][first] for name in NOISE},
        f"self_weight_at_{hi}": {name: source["methods"][name]["self_weight"][hi] for name in compared},
        "softmax_self_weight": source["softmax_self_weight"],
    }


def load_blocks(name: str, args, run: dict):
    if name == "vit":
        start = time.perf_counter()
        model, x_test, accuracy = train_vit(args.device, args.epochs, args.train_images)
        print(f"softmax ViT: held-out accuracy {accuracy:.3f} ({time.perf_counter() - start:.0f} s to train)",
              flush=True)
        run["vit_test_accuracy"] = accuracy
        return capture_qkv(model, x_test[: args.images])
    return [synthetic_qkv(name, args.images, seed=1 if name == "iid" else 2, device=args.device)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    p.add_argument("--epochs", type=int, default=8, help="ViT training epochs")
    p.add_argument("--train_images", type=int, default=1500, help="ViT training images (of the 1500 available)")
    p.add_argument("--images", type=int, default=32,
                   help="held-out images (vit) or synthetic sequences whose attention is approximated")
    p.add_argument("--draws", type=int, default=2, help="independent draws of every random estimator")
    p.add_argument("--samples", type=int, nargs="+", default=SAMPLES)
    p.add_argument("--per_proposal", type=int, nargs="+", default=PER_PROPOSAL)
    p.add_argument("--output", type=Path, default=RESULTS / "approximation_quality.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 epoch on 100 images, 2 sequences, samples 4 and 16, 1-4 per proposal")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_images, args.images, args.draws = 1, 100, 2, 1
        args.samples, args.per_proposal = [4, 16], [1, 4]
    for name in ("epochs", "images", "draws"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1.")
    if not 50 <= args.train_images <= 1500:
        raise ValueError("--train_images must be between 50 (one batch) and 1500 (the training split).")
    for m in args.samples:
        if m < 1 or int(m**0.5) ** 2 != m:
            raise ValueError(f"--samples {m}: every count must be a perfect square (2-D landmarks), e.g. 4 9 16.")
    if sorted(set(args.samples)) != args.samples or sorted(set(args.per_proposal)) != args.per_proposal:
        raise ValueError("--samples and --per_proposal must be increasing, without repeats.")
    if args.per_proposal[0] < 1:
        raise ValueError("--per_proposal counts must be positive.")
    return args


def main(argv=None):
    args = parse_args(argv)
    setup = {"device": args.device, "images": args.images, "draws": args.draws, "tokens": TOKENS, "heads": HEADS,
             "head_dim": HEAD_DIM, "vit_layers": 4, "consistency_proposals": CONSISTENCY_PROPOSALS,
             "clusters": CLUSTERS, "cluster_noise": CLUSTER_NOISE, "quick": args.quick, "sources": args.sources,
             "epochs": args.epochs, "train_images": args.train_images, "samples": args.samples,
             "per_proposal": args.per_proposal}
    # decided before measuring: a file that is not this benchmark's report is refused with nothing run
    output = report_target(args.output, setup, REPORT_CHECK, f"{SCRIPT}.py", flag="--output")
    # what the run found beside its figures (the ViT's accuracy, the time, the threads): not the setup
    result = {"benchmark": "approximation_quality", "setup": setup, "run": {}, "labels": LABELS, "sources": {}}
    run_start = time.perf_counter()
    for name in args.sources:
        start = time.perf_counter()
        blocks = load_blocks(name, args, result["run"])
        torch.manual_seed(0)  # every estimator draws from the global generator
        with torch.no_grad():
            source = {"softmax_self_weight": softmax_self_weight(blocks), "reference_mse": reference_errors(blocks),
                      "methods": measure_counts(blocks, args.samples, args.draws),
                      "consistency": measure_consistency(blocks, args.per_proposal, args.draws)}
        source["findings"] = findings(source, args.samples, args.per_proposal)
        source["seconds"] = time.perf_counter() - start  # wall clock, ViT training included
        result["sources"][name] = source
        report(name, source, args.samples, args.per_proposal)
    result["run"]["seconds"] = time.perf_counter() - run_start
    result["run"]["torch_threads"] = torch.get_num_threads()
    write_report(output, result, indent=2)
    plot(result, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}")
    return result


def report(name: str, source: dict, samples, per_proposal) -> None:
    refs = source["reference_mse"]
    print(f"\n== {name} ({source['seconds']:.0f} s); softmax self weight {source['softmax_self_weight']:.4f}; MSE of "
          f"uniform attention {refs['uniform_attention']:.3e}, of a zero output {refs['zero_output']:.3e}")
    print(f"{'method':22s} " + " ".join(f"{m:>9d}" for m in samples) + "   (MSE | ESS/samples | self weight)")
    for method, values in source["methods"].items():
        for metric in ("mse", "ess", "self_weight"):
            cells = [values[metric][str(m)] / (m if metric == "ess" else 1) for m in samples]
            label = method if metric == "mse" else ""
            print(f"{label:22s} " + " ".join(f"{c:9.3e}" for c in cells))
        if "row_mass" in values:
            print(f"{'  (row mass)':22s} " + " ".join(f"{values['row_mass'][str(m)]:9.3e}" for m in samples))
    print(f"consistency at {CONSISTENCY_PROPOSALS} proposals, samples per proposal {per_proposal}:")
    for method, values in source["consistency"].items():
        print(f"  {method:20s} " + " ".join(f"{values['mse'][str(p)]:9.3e}" for p in per_proposal))
    print(json.dumps(source["findings"]["ordering_by_mse"], indent=1), flush=True)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = result["sources"]
    fig, axes = plt.subplots(len(sources), 4, figsize=(19, 4.2 * len(sources)), squeeze=False)
    for row, (name, source) in zip(axes, sources.items(), strict=True):
        title = name if name != "vit" else f"vit (digits, acc {result['run']['vit_test_accuracy']:.2f})"
        for method, values in source["methods"].items():
            style, color = STYLES[method]
            counts = sorted(int(m) for m in values["mse"])
            row[0].plot(counts, [values["mse"][str(m)] for m in counts], style, color=color, label=LABELS[method])
            row[2].plot(counts, [values["ess"][str(m)] / m for m in counts], style, color=color)
            row[3].plot(counts, [values["self_weight"][str(m)] for m in counts], style, color=color)
        for method, values in source["consistency"].items():
            style, color = STYLES[method]
            pers = sorted(int(p) for p in values["mse"])
            row[1].plot(pers, [values["mse"][str(p)] for p in pers], style, color=color)
        for ax in row[:2]:
            ax.axhline(source["reference_mse"]["uniform_attention"], color="grey", lw=1, ls="--",
                       label="uniform attention (mean value)")
            ax.axhline(source["reference_mse"]["zero_output"], color="grey", lw=1, ls=":", label="zero output")
        row[3].axhline(source["softmax_self_weight"], color="k", lw=1, ls="--", label="exact softmax")
        row[0].set_ylabel(f"{title}\nMSE against softmax")
        row[1].set_ylabel("MSE against softmax")
        row[2].set_ylabel("effective sample size / samples")
        row[3].set_ylabel("weight on the query's own position")
        for ax in row:
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
        row[0].set_yscale("log")
        row[1].set_yscale("log")
        row[3].set_yscale("log")
        row[0].set_xlabel("samples (features / proposals / RA draws)")
        row[1].set_xlabel(f"LARA samples per proposal ({result['setup']['consistency_proposals']} proposals)")
        row[2].set_xlabel("samples")
        row[3].set_xlabel("samples")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(axes[0][3].get_legend_handles_labels()[0][0])
    labels.append("exact softmax (self weight)")
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9)
    fig.suptitle("Attention approximation (Figure 1 of arXiv 2204.04667): 196 tokens, head dim 64; columns: error "
                 "against samples, LARA consistency at fixed proposals, effective sample size, self weight",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_refusal(main, f"{SCRIPT}.py")
