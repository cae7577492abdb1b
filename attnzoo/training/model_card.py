"""Model cards: a `huggingface_hub.ModelCard` rendered from a `model_cards/` template, with the measured metrics
as `model-index` results (`EvalResult`), the recipe and the training steps."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "model_cards"

PAPERS = {
    "reformer": "Kitaev, Kaiser, Levskaya. Reformer: The Efficient Transformer. ICLR 2020.",
    "performer": "Choromanski et al. Rethinking Attention with Performers. ICLR 2021.",
    "ra": "Zheng, Wang, Kong. Linear Complexity Randomized Self-attention Mechanism. ICML 2022.",
    "lara": "Zheng, Wang, Kong. Linear Complexity Randomized Self-attention Mechanism. ICML 2022.",
    "softmax": "Vaswani et al. Attention Is All You Need. NeurIPS 2017.",
}


def template_path(name: str, override: str | None = None) -> Path:
    path = Path(override) if override else TEMPLATE_DIR / f"{name}.md"
    if not path.is_file():
        raise ValueError(f"model card template {path} not found; pass --model_card_template FILE.md.")
    return path


def family_of(config) -> str:
    return str(config.model_type).removeprefix("attnzoo_")


def architecture_summary(config, num_parameters: int) -> str:
    """One line a reader can compare across families. Fields a config lacks are left out: the scripts also train
    other libraries' checkpoints (e.g. a transformers GPT-2 that is then converted to a zoo family)."""
    parts = [f"{config.model_type}", f"{num_parameters / 1e6:.2f}M parameters",
             f"{config.num_hidden_layers} layers", f"hidden {config.hidden_size}",
             f"{config.num_attention_heads} heads"]
    if getattr(config, "intermediate_size", None):
        parts.append(f"FFN {config.intermediate_size}")
    if getattr(config, "attn_layers", None):
        parts.append(f"attention {list(config.attn_layers)}")
    if getattr(config, "is_encoder_decoder", False):
        parts.append(f"decoder {config.num_decoder_layers} layers, attention {list(config.decoder_attn_layers)}")
    if getattr(config, "reversible", False):
        parts.append("reversible residual layers")
    if getattr(config, "position_embedding_type", None):
        parts.append(f"{config.position_embedding_type} positions")
    return ", ".join(parts)


def recipe_text(args) -> str:
    """The recipe file as written (if any) and the resolved arguments, as YAML."""
    resolved = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
                if k not in ("hub_token",)}
    text = ""
    if getattr(args, "recipe", None):
        text += f"# recipe file: {args.recipe}\n{Path(args.recipe).read_text().rstrip()}\n\n"
    return text + "# resolved arguments\n" + yaml.safe_dump(resolved, sort_keys=True)


def build_model_card(template: str, *, args, config, num_parameters: int, results: dict,
                     eval_results: list[EvalResult], pipeline_tag: str, datasets: list[str] | None = None,
                     language=None, extra_tags: list[str] | None = None, **template_kwargs) -> ModelCard:
    family = family_of(config)
    repo_id = args.hub_model_id or Path(args.output_dir).absolute().name
    card_data = ModelCardData(
        language=language, license="apache-2.0", library_name="transformers", pipeline_tag=pipeline_tag,
        tags=["attnzoo", config.model_type, "efficient-attention", *(extra_tags or [])],
        datasets=datasets or None, model_name=repo_id, eval_results=eval_results or None,
        base_model=args.model_name_or_path if getattr(args, "model_name_or_path", None) else None,
    )
    return ModelCard.from_template(
        card_data, template_path=str(template_path(template, getattr(args, "model_card_template", None))),
        model_id=repo_id, family=family, paper=PAPERS.get(family, ""),
        architecture=architecture_summary(config, num_parameters), results=results,
        results_json=json.dumps(results, indent=2, default=str), recipe=recipe_text(args),
        steps=results.get("train_steps"), **template_kwargs,
    )


def bits_per_dim_result(value: float, dataset_name: str, dataset_type: str, split: str,
                        task_type: str = "text-generation", config: str | None = None) -> EvalResult:
    return EvalResult(task_type=task_type, task_name="density estimation (bits/dim)", dataset_type=dataset_type,
                      dataset_name=dataset_name, dataset_split=split, dataset_config=config,
                      metric_type="bits_per_dim", metric_name="bits/dim", metric_value=round(float(value), 4))


def bleu_results(bleu: dict, dataset_name: str, dataset_type: str, split: str, config: str | None) -> list:
    """One EvalResult per BLEU variant, each with its sacreBLEU signature as `metric_config`."""
    return [EvalResult(task_type="translation", task_name="Translation", dataset_type=dataset_type,
                       dataset_name=dataset_name, dataset_config=config, dataset_split=split,
                       metric_type="bleu", metric_name=name, metric_value=round(float(entry["score"]), 2),
                       metric_config=entry["signature"])
            for name, entry in bleu.items()]


def top1_result(value: float, dataset_name: str, dataset_type: str, split: str) -> EvalResult:
    return EvalResult(task_type="image-classification", task_name="Image Classification", dataset_type=dataset_type,
                      dataset_name=dataset_name, dataset_split=split, metric_type="accuracy",
                      metric_name="top-1 accuracy", metric_value=round(float(value), 4))


#: where lm-eval results come from (`source` of their model-index entries; the card's lm-eval table lists these)
LM_EVAL_SOURCE = ("lm-evaluation-harness", "https://github.com/EleutherAI/lm-evaluation-harness")
# The card's lm-eval section sits between these lines, so a later evaluation rewrites it and leaves the rest alone.
LM_EVAL_BEGIN = "<!-- lm-eval results: scripts/evaluate.py rewrites this section -->"
LM_EVAL_END = "<!-- end of lm-eval results -->"


def lm_eval_results(rows: list[dict], lm_eval_version: str) -> list[EvalResult]:
    """One EvalResult per row of `attnzoo.evaluation.harness.summarize`: the task as data set (lm-eval's data set id
    as its type), the metric (with its filter when there is one), and as `metric_config` what makes the number
    reproducible: lm-eval's version, the shots, how many of the task's documents were scored, the standard error."""
    results = []
    for row in rows:
        settings = [f"lm-eval {lm_eval_version}", f"{row['num_fewshot'] or 0}-shot"]
        if row.get("samples") is not None:
            settings.append(f"{row['samples']} of {row.get('task_samples') or row['samples']} documents")
        if row.get("stderr") is not None:
            settings.append(f"stderr {row['stderr']:.4g}")
        metric_name = row["metric"] if row["filter"] == "none" else f"{row['metric']} ({row['filter']})"
        results.append(EvalResult(task_type="text-generation", task_name=row["task"], dataset_type=row["dataset"],
                                  dataset_name=row["task"], dataset_split=row.get("split"),
                                  metric_type=row["metric"], metric_name=metric_name,
                                  metric_value=round(float(row["value"]), 4), metric_config=", ".join(settings),
                                  source_name=LM_EVAL_SOURCE[0], source_url=LM_EVAL_SOURCE[1]))
    return results


def _result_key(result: EvalResult) -> tuple:
    return (result.task_type, result.dataset_type, result.dataset_name, result.dataset_config, result.dataset_split,
            result.metric_type, result.metric_name)


def lm_eval_section(eval_results: list[EvalResult]) -> str:
    """The card's lm-eval table: every result the card holds from lm-eval, by task."""
    rows = sorted((r for r in eval_results if r.source_name == LM_EVAL_SOURCE[0]),
                  key=lambda r: (r.dataset_name, r.metric_name or r.metric_type))
    lines = [LM_EVAL_BEGIN, "## lm-evaluation-harness", "",
             "Measured with [lm-evaluation-harness](https://github.com/EleutherAI/lm-evaluation-harness) through "
             "`scripts/evaluate.py --lm_eval_tasks` (see docs/evaluation.md).", "",
             "| task | metric | value | split | settings |", "|---|---|---|---|---|"]
    lines += [f"| {r.dataset_name} | {r.metric_name or r.metric_type} | {r.metric_value} | {r.dataset_split or ''} | "
              f"{r.metric_config or ''} |" for r in rows]
    return "\n".join([*lines, LM_EVAL_END])


#: where passkey results come from (benchmarks/passkey_retrieval.py writes them; the card's passkey table lists these)
PASSKEY_SOURCE = ("attnzoo passkey retrieval", "https://arxiv.org/abs/2305.16300")
PASSKEY_BEGIN = "<!-- passkey results: benchmarks/passkey_retrieval.py rewrites this section -->"
PASSKEY_END = "<!-- end of passkey results -->"


def passkey_eval_results(accuracy: dict, setup: dict) -> list[EvalResult]:
    """One EvalResult per prompt length of `attnzoo.evaluation.passkey.passkey_accuracy`'s `accuracy` ({length:
    {depth: fraction or None}}): the mean over the depths that ran, with the depths, trials, filler and seed as its
    `metric_config`; lengths with no depth run are left out."""
    results = []
    for length, by_depth in accuracy.items():
        ran = {depth: value for depth, value in by_depth.items() if value is not None}
        if not ran:
            continue
        per_depth = ", ".join(f"{float(depth):.0%}: {value:.2f}" for depth, value in ran.items())
        settings = (f"{setup['trials']} keys per depth, {setup['digits']} digits, filler {setup['filler']}, "
                    f"seed {setup['seed']}, greedy; by depth {per_depth}")
        results.append(EvalResult(task_type="text-generation", task_name="passkey retrieval",
                                  dataset_type="attnzoo-passkey", dataset_name=f"passkey retrieval, {length} tokens",
                                  metric_type="accuracy", metric_name="accuracy (mean over depths)",
                                  metric_value=round(sum(ran.values()) / len(ran), 4), metric_config=settings,
                                  source_name=PASSKEY_SOURCE[0], source_url=PASSKEY_SOURCE[1]))
    return results


def passkey_section(eval_results: list[EvalResult]) -> str:
    """The card's passkey table: every passkey result the card holds, by prompt length."""
    rows = sorted((r for r in eval_results if r.source_name == PASSKEY_SOURCE[0]),
                  key=lambda r: int(r.dataset_name.rsplit(", ", 1)[1].split()[0]))
    lines = [PASSKEY_BEGIN, "## Passkey retrieval", "",
             "A 5-digit pass key hidden in filler text at several depths, asked for at the end, greedy decoding "
             "(`benchmarks/passkey_retrieval.py`; see docs/evaluation.md).", "",
             "| prompt length | accuracy | settings |", "|---|---|---|"]
    lines += [f"| {r.dataset_name.rsplit(', ', 1)[1]} | {r.metric_value} | {r.metric_config or ''} |" for r in rows]
    return "\n".join([*lines, PASSKEY_END])


#: the card's measured sections: (first line, last line, the results' source, how the section is rendered)
RESULT_SECTIONS = ((LM_EVAL_BEGIN, LM_EVAL_END, LM_EVAL_SOURCE[0], lm_eval_section),
                   (PASSKEY_BEGIN, PASSKEY_END, PASSKEY_SOURCE[0], passkey_section))


def _with_section(text: str, begin: str, end: str, section: str) -> str:
    """`text` with the section between `begin` and `end` replaced by `section`, or `section` added before the
    card's usage part (the templates' order: results first, then usage), or at the end."""
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        return before + section + rest.split(end, 1)[1]
    if "\n## How to use" in text:
        before, after = text.split("\n## How to use", 1)
        return f"{before.rstrip()}\n\n{section}\n\n## How to use{after}"
    return f"{text.rstrip()}\n\n{section}\n"


def add_eval_results(card_path: str | Path, eval_results: list[EvalResult], model_name: str) -> ModelCard:
    """Write `eval_results` into the model card at `card_path` (a new card when there is none): they join its
    `model-index` results (bits/dim, BLEU, ...), replacing earlier ones of the same task, data set, split and
    metric, and the card's lm-eval and passkey sections are rebuilt from all the results of their kind it then
    holds."""
    path = Path(card_path)
    if path.is_file():
        card = ModelCard.load(path)
    else:
        card = ModelCard(f"---\n{ModelCardData(library_name='transformers', tags=['attnzoo']).to_yaml()}\n---\n\n"
                         f"# {model_name}\n")
    new_keys = {_result_key(r) for r in eval_results}
    kept = [r for r in (card.data.eval_results or []) if _result_key(r) not in new_keys]
    card.data.eval_results = kept + list(eval_results)
    card.data.model_name = card.data.model_name or model_name
    text = card.text
    for begin, end, source, render in RESULT_SECTIONS:
        if any(r.source_name == source for r in card.data.eval_results):
            text = _with_section(text, begin, end, render(card.data.eval_results))
    card.text = text
    card.save(path)
    return card
