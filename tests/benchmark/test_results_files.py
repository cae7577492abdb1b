"""Issue 45, for every benchmark that writes a JSON report (and plot) outside the training family: the results file
follows the output-folder rule of benchmarks/owned_outputs.py. A user's own JSON (or picture) at the results path is
refused before anything is measured and left byte for byte; a report of the benchmark's own with the same setup is
replaced, one of another setup gains a report beside it; the committed reports in benchmarks/results/ are recognised
as their benchmark's own (and only as its), read here, never written. Measurements are stubbed where the rule, not
the figure, is under test."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import runpy
import shutil
import sys

import pytest
import torch

from tests.scripts_helpers import ROOT, load_module

RESULTS = ROOT / "benchmarks" / "results"


def bench(name: str):
    """benchmarks/NAME.py as a fresh module. compile_speed.py sets TORCHINDUCTOR_FORCE_DISABLE_CACHES when imported
    (for its own process): the variable is put back, so later tests keep their inductor caches."""
    before = os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    try:
        return load_module(ROOT / "benchmarks", name)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
        else:
            os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = before


if str(ROOT / "benchmarks") not in sys.path:  # as load_module puts it: the benchmarks import their siblings
    sys.path.insert(0, str(ROOT / "benchmarks"))
owned = importlib.import_module("owned_outputs")  # the module the benchmarks import


def tree(folder) -> dict:
    """Every file under `folder` with its bytes' digest: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def check_of(module):
    return getattr(module, "REPORT_CHECK", None) or module.check_report


# -- a user's own JSON at the results path ---------------------------------------------------------------------
#: benchmark -> (its arguments, the results file given as {out} (None: the default under RESULTS, patched to the
#: test's folder), the measuring function that must not run)
CASES = {
    "approximation_quality": (["--quick", "--output", "{out}"], "load_blocks"),
    "compile_speed": (["--quick", "--output", "{out}"], "measure"),
    "conversion_fidelity": (["--results", "{out}"], "gpt2_fidelity"),
    "decayed_linear_cpu": (["--quick", "--output", "{out}"], "scan_rows"),
    "decoding_speed": (["--tiny", "--output", "{out}"], "run_worker"),
    "kernels_gpu": (["--quick", "--no_fla", "--output", "{out}"], "linear_steps"),
    "lsh_decoding_state": (["--lengths", "64", "--results", "{out}"], "run_worker"),
    "lsh_far_paths": (["--output", "{out}"], "layer"),
    "near_part_speed": (["--lengths", "128", "--results", "{out}"], "run_worker"),
    "paper_size_reformer": (["--tiny", "--output", "{out}"], "run_worker"),
    "passkey_retrieval": (["--model", "{tmp}/model", "--lengths", "64", "--results", "{out}"], "evaluate"),
    "performer_speed": (["--train_lengths", "64", "--decode_contexts", "64"], "run_worker"),
    "randomized_efficiency": (["--lengths", "64"], "run_worker"),
    "reformer_attention_speed": (["--output", "{out}"], "measure"),
    "reformer_duplication": (["--output", "{out}"], "run_worker"),
    "reformer_vs_transformers": (["--lengths", "1024", "--output", "{out}"], "run_worker"),
    "reversible_memory": (["--output", "{out}"], "make_model"),
    "short_sequence_speed": (["--tiny", "--results", "{out}"], "step_time"),
    "training_memory": (["--lengths", "128", "--results", "{out}"], "run_worker"),
}
#: the benchmarks measured with their default results file (benchmarks/gpu_session.sh runs them so)
DEFAULT_PATHS = {"performer_speed": "performer_speed_cpu.json",
                 "randomized_efficiency": "randomized_efficiency_cpu.json"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """kernels_gpu.py past its CUDA check on this machine: a named device, nothing measured on it."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def prepared(name, tmp_path, monkeypatch):
    """The benchmark, its arguments and its results path in `tmp_path`, its measurement failing the test if run."""
    module = bench(name)
    argv, measuring = CASES[name]
    monkeypatch.setattr(module, measuring, lambda *a, **k: pytest.fail(f"{name} measured before refusing"))
    if name in DEFAULT_PATHS:
        monkeypatch.setattr(module, "RESULTS", tmp_path)
        out = tmp_path / DEFAULT_PATHS[name]
    else:
        out = tmp_path / "mine.json"
    return module, [a.format(out=out, tmp=tmp_path) for a in argv], out


@pytest.mark.parametrize("name", list(CASES))
def test_a_users_own_json_and_picture_are_refused_and_left_as_they_are(name, tmp_path, monkeypatch, request):
    if name == "kernels_gpu":
        request.getfixturevalue("fake_gpu")
    module, argv, out = prepared(name, tmp_path, monkeypatch)
    out.write_text('{"my": "scores"}')
    before = tree(tmp_path)
    with pytest.raises(owned.Refused) as refused:
        module.main(argv)
    message = str(refused.value)
    flag = "--results" if name in ("conversion_fidelity", "lsh_decoding_state", "near_part_speed",
                                   "passkey_retrieval", "short_sequence_speed", "training_memory") else "--output"
    assert message.startswith(f"{flag} {out} is not a report of benchmarks/{name}.py: "), message
    assert message.endswith(f"nothing was written: name another {flag} (or move that file away).")
    assert "\n" not in message
    assert tree(tmp_path) == before  # byte for byte, and no plot beside it
    # a picture with no report of the benchmark's beside it is not drawn over either
    out.unlink()
    picture = (out.with_name(f"{out.stem}_model.png") if name == "passkey_retrieval" else out.with_suffix(".png"))
    picture.write_bytes(b"the user's picture")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=f"{picture.name} exists with no report of benchmarks/{name}.py"):
        module.main(argv)
    assert tree(tmp_path) == before


def test_a_users_json_is_not_merged_into(tmp_path, monkeypatch):
    """decoding_speed.py --merge adds rows only to a report of its own."""
    module, argv, out = prepared("decoding_speed", tmp_path, monkeypatch)
    out.write_text('{"my": "scores", "rows": []}')
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=f"--output {out} is not a report of benchmarks/decoding_speed.py: it has "
                                            r"no 'environment'.*--merge adds only to a report of this benchmark"):
        module.main([*argv, "--merge"])
    assert tree(tmp_path) == before


def test_a_folder_of_someone_elses_patches_is_refused(tmp_path):
    """prepare_photo_patches.py wrote train.npy, validation.npy and info.json over whatever the folder held."""
    prep = bench("prepare_photo_patches")
    (tmp_path / "train.npy").write_bytes(b"the user's array")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"holds train\.npy, which benchmarks/prepare_photo_patches\.py did not "
                                            r"make .*Pick another --output_dir"):
        prep.main(["--output_dir", str(tmp_path), "--patch_size", "8", "--train_patches", "4"])
    assert tree(tmp_path) == before
    # its own patches: the same setup again replaces them, another setup is refused
    (tmp_path / "train.npy").unlink()
    prep.main(["--output_dir", str(tmp_path), "--patch_size", "8", "--train_patches", "4"])
    prep.main(["--output_dir", str(tmp_path), "--patch_size", "8", "--train_patches", "4"])
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match="holds patches of another setup"):
        prep.main(["--output_dir", str(tmp_path), "--patch_size", "8", "--train_patches", "5"])
    assert tree(tmp_path) == before


def test_the_command_line_prints_one_line_not_a_traceback(tmp_path, monkeypatch):
    mine = tmp_path / "mine.json"
    mine.write_text("[1, 2]")
    before = tree(tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmarks/lsh_far_paths.py", "--output", str(mine)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "benchmarks" / "lsh_far_paths.py"), run_name="__main__")
    assert exited.value.code == (f"benchmarks/lsh_far_paths.py: error: --output {mine} holds a JSON list, not a "
                                 "report of benchmarks/lsh_far_paths.py (a JSON object). It is left as it is and "
                                 "nothing was written: name another --output (or move that file away).")
    assert tree(tmp_path) == before


# -- the benchmark's own reports: the same setup replaced, another beside --------------------------------------
def outputs(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_cpu_timing_report_is_replaced_by_its_own_setup_and_another_goes_beside(tmp_path):
    """reformer_attention_speed.py, measured for real at toy sizes."""
    speed = bench("reformer_attention_speed")
    out = tmp_path / "speed.json"
    flags = ["--total_tokens", "32", "--lengths", "16", "32", "--attentions", "full", "--hidden_size", "16",
             "--num_heads", "2", "--chunk_length", "8", "--repeats", "1", "--output", str(out)]
    speed.main(flags)
    first = json.loads(out.read_text())
    assert first["benchmark"] == "reformer_attention_speed" and first["setup"]["lengths"] == [16, 32]
    speed.main(flags)  # the same setup: its own report, replaced
    assert outputs(tmp_path) == ["speed.json", "speed.png"]
    speed.main([*flags, "--repeats", "2"])  # another setup: beside it, with its plot
    assert json.loads(out.read_text())["setup"] == first["setup"]
    other = owned.beside(out, {**first["setup"], "repeats": 2})
    assert outputs(tmp_path) == sorted(["speed.json", "speed.png", other.name, other.with_suffix(".png").name])
    assert json.loads(other.read_text())["setup"]["repeats"] == 2


def test_a_decoding_report_is_replaced_by_its_own_setup_and_another_goes_beside(tmp_path, monkeypatch):
    """decoding_speed.py (a GPU benchmark) through its --tiny path on the CPU, the worker stubbed (tests/benchmark/
    test_decoding_speed.py runs it)."""
    decoding = bench("decoding_speed")

    def worker(script, args):
        return {"rows": [{"impl": job["impl"], "batch": job["batch"], "context": job["context"], "status": "ok",
                          "ms_per_token": 1.0, "decode_peak_MiB": 1.0} for job in json.loads(args[0])]}

    monkeypatch.setattr(decoding, "run_worker", worker)
    out = tmp_path / "decoding.json"
    flags = ["--tiny", "--families", "performer", "--batch_sizes", "1", "--contexts", "64",
             "--skip_transformers_static", "--output", out]
    first = decoding.main(flags)
    assert first["benchmark"] == "decoding_speed" and first["setup"]["families"] == ["performer"]
    decoding.main(flags)
    assert outputs(tmp_path) == ["decoding.json", "decoding.png"]
    other = decoding.main([*flags, "--contexts", "128"])
    beside = owned.beside(out, other["setup"])
    assert outputs(tmp_path) == sorted(["decoding.json", "decoding.png", beside.name, beside.with_suffix(".png").name])
    # --merge adds to a report of its own, whose setup then covers both runs
    merged = decoding.main([*flags, "--contexts", "128", "--merge"])
    assert merged["setup"]["contexts"] == [64, 128] and {r["context"] for r in merged["rows"]} == {64, 128}
    assert json.loads(out.read_text())["setup"] == merged["setup"]


def test_a_paper_size_report_is_replaced_by_its_own_setup_and_another_goes_beside(tmp_path, monkeypatch):
    """paper_size_reformer.py (a GPU benchmark) through its --tiny path, the workers stubbed."""
    paper = bench("paper_size_reformer")

    def worker(script, args):
        job = json.loads(args[0])
        return {"impl": job["impl"], "length": job["length"], "status": "ok", "fits": True, "step_s": 1.0,
                "tokens_per_s": 1024.0, "step_peak_MiB": 1.0, "total_peak_MiB": 2.0}

    monkeypatch.setattr(paper, "run_worker", worker)
    out = tmp_path / "paper.json"
    flags = ["--tiny", "--models", "attnzoo", "--output", out]
    first = paper.main(flags)
    assert first["benchmark"] == "paper_size_reformer" and first["setup"]["models"] == ["attnzoo"]
    paper.main(flags)
    assert outputs(tmp_path) == ["paper.json", "paper.png"]
    other = paper.main([*flags, "--repeats", "2"])
    beside = owned.beside(out, other["setup"])
    assert outputs(tmp_path) == sorted(["paper.json", "paper.png", beside.name, beside.with_suffix(".png").name])
    # decoding_speed.py's reports have the same top-level keys: not this benchmark's
    (tmp_path / "decoding.json").write_text((RESULTS / "decoding_speed_cpu.json").read_text())
    with pytest.raises(owned.Refused, match="its 'settings' have no 'num_hashes'"):
        paper.main(["--tiny", "--output", tmp_path / "decoding.json"])


def test_a_kernels_report_is_replaced_by_its_own_setup_and_another_goes_beside(tmp_path, monkeypatch, fake_gpu):
    """kernels_gpu.py (CUDA only) past its CUDA check, nothing measured: the committed H100 report (a copy) is replaced
    by the run benchmarks/gpu_session.sh makes on an H100 (`--quick --no_fla`), and a run of another setup goes
    beside it."""
    kernels = bench("kernels_gpu")
    monkeypatch.setattr(kernels, "RESULTS", tmp_path)
    monkeypatch.setattr(kernels, "linear_steps", lambda length, fla: {"torch": None, "sdpa": None})
    monkeypatch.setattr(kernels, "windowed_steps", lambda kind, length: {"torch": None, "sdpa": None})
    monkeypatch.setattr(kernels, "measure", lambda make_step, repeats: {"forward_ms": 1.0, "train_ms": 2.0,
                                                                       "train_peak_mib": 3.0})
    committed = tmp_path / "kernels_gpu_nvidia_h100_80gb_hbm3.json"
    if not (RESULTS / committed.name).is_file():
        pytest.skip("no committed H100 report")
    for suffix in (".json", ".png"):
        shutil.copy((RESULTS / committed.name).with_suffix(suffix), committed.with_suffix(suffix))
    kernels.main(["--quick", "--no_fla"])
    report = json.loads(committed.read_text())
    assert report["benchmark"] == "kernels_gpu" and report["complete"] and outputs(tmp_path) == [
        committed.name, committed.with_suffix(".png").name]
    kernels.main(["--quick", "--no_fla", "--ops", "linear"])
    beside = owned.beside(committed, {**report["setup"], "ops": ["linear"]})
    assert json.loads(beside.read_text())["setup"]["ops"] == ["linear"] and beside.with_suffix(".png").is_file()


def test_reversible_memory_keeps_the_other_section_and_puts_another_setup_beside(tmp_path):
    """reversible_memory.py's report holds a "cpu" and a "cuda" section, one per run: a CPU run fills its own
    section (the committed CUDA section kept), is replaced by its own setup, and another setup goes beside."""
    memory = bench("reversible_memory")
    out = tmp_path / "reversible_memory.json"
    committed = json.loads((RESULTS / "reversible_memory.json").read_text())
    out.write_text(json.dumps({"cuda": committed["cuda"]}))
    flags = ["--depths", "1", "2", "--hidden", "16", "--heads", "2", "--length", "16", "--batch", "1",
             "--output", str(out)]
    memory.main(flags)
    report = json.loads(out.read_text())
    assert report["cuda"] == committed["cuda"] and report["cpu"]["setup"]["depths"] == [1, 2]
    memory.main(flags)
    assert outputs(tmp_path) == ["reversible_memory.json", "reversible_memory.png"]
    memory.main([*flags[:-2], "--length", "32", "--output", str(out)])
    beside = owned.beside(out, {"cpu": {**report["cpu"]["setup"], "length": 32}})
    assert json.loads(beside.read_text())["cpu"]["setup"]["length"] == 32 and "cuda" not in json.loads(
        beside.read_text())
    assert json.loads(out.read_text())["cpu"]["setup"] == report["cpu"]["setup"]


def test_passkey_heatmaps_are_not_drawn_over_a_picture_with_no_report(tmp_path, monkeypatch):
    passkey = bench("passkey_retrieval")
    monkeypatch.setattr(passkey, "evaluate", lambda path, args: pytest.fail("evaluated before refusing"))
    (tmp_path / "pk_tiny.png").write_bytes(b"the user's picture")
    before = tree(tmp_path)
    with pytest.raises(owned.Refused, match=r"pk_tiny\.png exists with no report of benchmarks/passkey_retrieval\.py"):
        passkey.main(["--model", str(tmp_path / "tiny"), "--results", str(tmp_path / "pk.json")])
    assert tree(tmp_path) == before


# -- the committed reports --------------------------------------------------------------------------------------
#: each committed report -> the benchmark that wrote it (None: a benchmark not routed here, whose checks are its own)
COMMITTED = {
    "approximation_quality.json": "approximation_quality",
    "compile_speed_cpu.json": "compile_speed",
    "conversion_fidelity.json": "conversion_fidelity",
    "decayed_linear_cpu.json": "decayed_linear_cpu",
    "decoding_speed_cpu.json": "decoding_speed",
    "decoding_speed_cuda.json": "decoding_speed",
    "kernels_gpu_nvidia_h100_80gb_hbm3.json": "kernels_gpu",
    "lsh_decoding_state.json": "lsh_decoding_state",
    "lsh_far_paths.json": "lsh_far_paths",
    "near_part_speed.json": "near_part_speed",
    "lsh_round_union_after.json": "reformer_attention_speed",
    "lsh_round_union_before.json": "reformer_attention_speed",
    "passkey_retrieval.json": "passkey_retrieval",
    "performer_speed_cpu.json": "performer_speed",
    "performer_speed_cuda.json": "performer_speed",
    "randomized_efficiency_cpu.json": "randomized_efficiency",
    "randomized_efficiency_cuda.json": "randomized_efficiency",
    "reformer_attention_speed.json": "reformer_attention_speed",
    "reformer_duplication.json": "reformer_duplication",
    "reformer_vs_transformers.json": "reformer_vs_transformers",
    "reformer_vs_transformers_cpu_long.json": "reformer_vs_transformers",
    "reformer_vs_transformers_cuda_partial.json": "reformer_vs_transformers",
    "reversible_memory.json": "reversible_memory",
    "short_sequence_speed_cpu.json": "short_sequence_speed",
    "training_memory.json": "training_memory",
    **dict.fromkeys(["causal_lara_lm.json", "conversion_recovery.json", "llama_uptraining.json", "long_context.json",
                     "pretrained_long_context.json", "reformer_hash_rounds.json", "reformer_shared_qk_reversible.json",
                     "uptraining.json"]),
}
ROUTED = sorted(set(CASES))
#: the benchmarks whose committed reports state their setup (under other names), so a run of the same setup replaces
#: them; the others' gain a report beside them
STATED = ("compile_speed", "decayed_linear_cpu", "decoding_speed", "kernels_gpu", "lsh_far_paths",
          "reformer_attention_speed", "reformer_duplication", "short_sequence_speed")


@pytest.fixture(scope="module")
def modules():
    return {name: bench(name) for name in ROUTED}


@pytest.mark.parametrize("file", [f for f, name in COMMITTED.items() if (RESULTS / f).is_file()])
def test_each_committed_report_is_its_benchmarks_own_and_no_others(file, modules):
    path = RESULTS / file
    owner = COMMITTED[file]
    accepted = []
    for name, module in modules.items():
        try:
            owned.read_report(path, check_of(module), name)
            accepted.append(name)
        except owned.Refused:
            pass
    assert accepted == ([owner] if owner else [])


@pytest.mark.parametrize("file", [f for f, name in COMMITTED.items() if name and (RESULTS / f).is_file()])
def test_a_run_replaces_a_committed_report_only_with_its_setup(file, modules):
    """Read only: where a run of each setup would write (the committed report is this benchmark's own)."""
    path, name = RESULTS / file, COMMITTED[file]
    module = modules[name]
    check, setup_of = check_of(module), getattr(module, "LEGACY_SETUP", None)
    report = json.loads(path.read_text())
    other = {"another": "setup"}
    if name == "reversible_memory":  # one section per run
        for key in ("cpu", "cuda"):
            setup = module.section_setup(report[key])
            assert module.results_target(path, key, setup) == path
            assert module.results_target(path, key, {**setup, "batch": 99}) == owned.beside(
                path, {key: {**setup, "batch": 99}})
        return
    assert owned.report_target(path, other, check, name, companions=(), setup_of=setup_of) == owned.beside(path, other)
    if name in STATED:
        stated = setup_of(report)
        assert isinstance(stated, dict) and stated
        assert owned.report_target(path, stated, check, name, companions=(), setup_of=setup_of) == path


def test_the_committed_runs_would_replace_their_reports(monkeypatch):
    """The commands that made committed reports (their recipes, reformer_paper_claims.md), stopped where the report's
    path is decided, read only: each would replace its report. (Those whose setup names this machine's threads or
    device are left out: elsewhere they go beside it.)"""
    class Stop(Exception):
        pass

    def target_of(name, argv):
        module = bench(name)
        real, found = module.report_target, {}

        def decide(*args, **kwargs):
            found["target"] = real(*args, **kwargs)
            raise Stop

        monkeypatch.setattr(module, "report_target", decide)
        with pytest.raises(Stop):
            module.main(argv)
        return found["target"]

    union = RESULTS / "lsh_round_union_after.json"
    cases = [
        ("reformer_attention_speed", ["--recipe", str(ROOT / "benchmarks/recipes/reformer_attention_speed.yaml")],
         RESULTS / "reformer_attention_speed.json"),
        ("reformer_attention_speed", ["--total_tokens", "4096", "--lengths", "4096", "--attentions", "lsh-1",
                                      "lsh-2", "lsh-4", "lsh-8", "--backward", "--repeats", "5", "--output",
                                      str(union)], union),
        ("reformer_duplication", ["--recipe", str(ROOT / "benchmarks/recipes/reformer_duplication.yaml")],
         RESULTS / "reformer_duplication.json"),
        ("lsh_far_paths", [], RESULTS / "lsh_far_paths.json"),
        ("near_part_speed", [], RESULTS / "near_part_speed.json"),
        ("lsh_decoding_state", [], RESULTS / "lsh_decoding_state.json"),
        ("training_memory", [], RESULTS / "training_memory.json"),
    ]
    for name, argv, committed in cases:
        if committed.is_file():
            assert target_of(name, argv) == committed, name


def test_the_readme_table_is_rewritten_only_from_the_committed_report(tmp_path, monkeypatch):
    """short_sequence_speed.py: a full run whose report goes elsewhere (--results, or beside the committed one)
    leaves README.md's crossover table as it is; one that writes the committed report rewrites it. Steps stubbed."""
    short = bench("short_sequence_speed")
    monkeypatch.setattr(short, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(short, "step_time", lambda name, args, length, batch: 2.0 if name == "sdpa" else 1.0)
    monkeypatch.setattr(short, "ra_profile", lambda args: [])
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{short.TABLE_START}\nold\n{short.TABLE_END}\nafter\n")
    monkeypatch.setattr(short.update_readme, "__defaults__", (readme,))  # its README, bound when it was defined
    flags = ["--crossover_lengths", "64", "--repeats", "1"]
    short.main([*flags, "--results", str(tmp_path / "elsewhere.json")])
    assert "\nold\n" in readme.read_text()
    short.main(flags)  # the committed path (missing): written, and the table with it
    assert "| `favor` |" in readme.read_text() and (tmp_path / "results" / "short_sequence_speed_cpu.json").is_file()
    readme.write_text(f"before\n{short.TABLE_START}\nold\n{short.TABLE_END}\nafter\n")
    short.main([*flags, "--repeats", "2"])  # another setup: beside the committed report, the table left
    assert "\nold\n" in readme.read_text() and len(list((tmp_path / "results").glob("*.json"))) == 2
