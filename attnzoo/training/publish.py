"""The end of every run: results and arguments as JSON, the curves as a PNG, the model card, and the Hub upload."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from attnzoo.training.hub import push_folder, resolve_repo_id
from attnzoo.training.plots import plot_curves
from attnzoo.training.run_dir import record_outputs
from attnzoo.training.tracking import METRICS_FILE

RESULTS_FILE = "all_results.json"
ARGS_FILE = "training_args.json"


def write_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps(values, indent=2, default=str))


def publish_run(accelerator, args, results: dict, build_card: Callable, title: str) -> dict:
    """Main process: write all_results.json, training_args.json, curves.png and README.md into the output folder,
    then upload it with --push_to_hub. Every process waits for the main one."""
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        write_json(output_dir / RESULTS_FILE, results)
        write_json(output_dir / ARGS_FILE, {k: v for k, v in vars(args).items() if k != "hub_token"})
        plot_curves(output_dir / METRICS_FILE, output_dir / "curves.png", title=title)
        build_card().save(output_dir / "README.md")
        record_outputs(output_dir)
        if args.push_to_hub:
            url = push_folder(output_dir, resolve_repo_id(args), token=args.hub_token,
                              private=args.hub_private_repo)
            results["hub_commit_url"] = url
            accelerator.print(f"pushed to the Hub: {url}")
    accelerator.wait_for_everyone()
    return results
