"""Uploading a finished run folder to the Hugging Face Hub (or any server `HF_ENDPOINT` points at)."""

from __future__ import annotations

from pathlib import Path

# Training state is for resuming, not for users of the model: it stays local.
# (tokenizer/ is the translation script's copy of the BPE it trained, kept for resuming; the same files sit at the top.)
UPLOAD_IGNORE = ["checkpoints/*", "checkpoints/**", "*.partial/**", "hparams.json", "tokenizer/*"]


def resolve_repo_id(args) -> str:
    """--hub_model_id, else the output folder's name (as transformers' no_trainer examples do)."""
    return args.hub_model_id or Path(args.output_dir).absolute().name


def push_folder(folder: str | Path, repo_id: str, token: str | None = None, private: bool = False,
                commit_message: str = "End of training") -> str:
    """Create the model repository if needed and upload `folder` (model, tokenizer, README.md model card, metrics,
    curves) in one commit; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                               ignore_patterns=UPLOAD_IGNORE, repo_type="model")
    return str(getattr(commit, "commit_url", commit))
