"""What a benchmark may write: its own runs, its own report, and the tables of its committed report.

The benchmarks follow the output-folder rule of the scripts they run (`attnzoo/training/run_dir.py`,
docs/training.md "Output folders"), and this module is where they share it:

- **Runs** (`OutputFolder`). A benchmark's `--output_dir` is a folder of runs it made. It records itself there in
  run_dir's `run_args.json` (the benchmark, and every run, model and evaluation folder it started, recorded before
  anything is written into them) and writes only into a folder that is missing or that its record lists. A folder
  holding anything else (a user's own `train_lm.py` run, their lm-eval scores, a folder from before the record) is
  refused with a message naming it and the fix, before anything is written. The benchmark never passes
  `--overwrite_output_dir` on a user's behalf: a run of its own that must be redone is cleared by the run's own
  record (the files that run wrote, nothing else), and an interrupted run of the same command is resumed instead.
- **Reports** (`report_target`, `write_report`). A results file is replaced only when it is this benchmark's own
  report with the same setup. A report of another setup goes beside it, under a name made from its setup
  (`long_context-1a2b3c4d.json`), never over it; a file that is not this benchmark's report is refused. A plot is
  drawn only beside a report being written (never over a picture with no report of the benchmark's beside it).
- **Tables** (`publishes_tables`). The tables in README.md and the docs show the committed report: they are
  rewritten only from a report written to (or, with `--readme_only`, read from) the committed path. A run whose
  results go elsewhere, or whose setup differs (its report goes beside the committed one), leaves them as they are.

Errors are `Refused` (a ValueError): `exit_on_refusal` turns one into a one-line message and exit status 1 on the
command line, with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from attnzoo.training.run_dir import (
    CHECKPOINT_ENTRY,
    describe_folder,
    folder_contents,
    has_checkpoint,
    read_run_record,
    record_outputs,
    run_outputs,
    script_label,
    write_model_record,
    write_record,
)

#: what a benchmark's folder record says it holds (run_dir.describe_folder names such folders by it)
HOLDS = "benchmark runs"
#: the records a benchmark keeps of each of its runs, in its folder (a run's command, its evaluation ...)
RECORDS = "records"
#: the records long_context.py kept before its folder was recorded (records/NAME_KIND.json)
LEGACY_RECORD = re.compile(r"^(?P<name>.+)_(?P<kind>command|started|evaluation|scan)\.json$")


class Refused(ValueError):
    """A benchmark refused to write or read something; nothing was written. The message names the file and the fix."""


class BadArgument(ValueError):
    """A benchmark's argument that cannot work, found before anything is loaded or written; the message names the
    argument and the fix."""


def exit_on_refusal(main: Callable, script: str) -> None:
    """Run a benchmark's `main()`; a refusal or a bad argument ends it with its one-line message (no traceback) and
    exit status 1."""
    try:
        main()
    except (Refused, BadArgument) as error:
        raise SystemExit(f"{script}: error: {error}") from None


def as_recorded(value):
    """`value` as a JSON file holds it (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(value, default=str))


# -- the benchmark's folder of runs -------------------------------------------------------------------------------
class OutputFolder:
    """A benchmark's `--output_dir`: the runs, models and evaluations it made, each recorded before it is written.

    `script` names the benchmark in the record and the messages ("benchmarks/long_context"). `legacy` (optional)
    returns, for a folder with no record, the names the benchmark's own earlier versions wrote there (or None when it
    is not such a folder): those are adopted into the record on the first write, and nothing else is. Made before
    the benchmark writes anything, it refuses a folder the benchmark did not make (`check`); it creates nothing until
    the first write."""

    def __init__(self, root: str | Path, script: str, flag: str = "--output_dir",
                 legacy: Callable[[Path], list[str] | None] | None = None):
        self.root, self.script, self.flag, self.legacy = Path(root), script, flag, legacy
        self._adopted: list[str] | None = None
        self.check()

    @property
    def label(self) -> str:
        return script_label(self.script)

    def check(self) -> None:
        """Before the benchmark writes anything: the folder is missing or empty, or holds this benchmark's runs
        (recorded, or the layout of its earlier versions); anything else is refused."""
        if self.root.exists() and not self.root.is_dir():
            raise Refused(f"{self.flag} {self.root} is a file; name a folder for the benchmark's runs.")
        record = read_run_record(self.root)
        if record is not None and record.get("script") == self.script and record.get("holds") == HOLDS:
            return
        contents = folder_contents(self.root)
        if not contents:
            return
        if record is None and self.legacy is not None:
            self._adopted = self.legacy(self.root)
            if self._adopted is not None:
                return
        raise Refused(f"{self.flag} {self.root} holds {describe_folder(self.root)}, not the runs of {self.label}. "
                      f"The benchmark writes only into a folder it made (it records what it writes in "
                      f"{self.root / 'run_args.json'}), so it would overwrite or mix with these files. Nothing "
                      f"was written; pick another {self.flag} (a missing or empty folder).")

    def outputs(self) -> set[str]:
        """The paths (relative to the folder) the benchmark recorded writing."""
        record = read_run_record(self.root)
        owned = set(record.get("outputs", ())) if record is not None and record.get("holds") == HOLDS else set()
        return owned | set(self._adopted or ())

    def owns(self, rel: str) -> bool:
        return rel in self.outputs()

    def _record(self, rels: Iterable[str]) -> None:
        """Add `rels` (and the folders above them) to the folder's record, writing the record first if this is the
        benchmark's first write here."""
        names = {"/".join(Path(rel).parts[:i]) for rel in rels for i in range(1, len(Path(rel).parts) + 1)}
        record = read_run_record(self.root)
        if record is None or record.get("holds") != HOLDS:
            self.check()  # the folder may have changed since the benchmark started
            self.root.mkdir(parents=True, exist_ok=True)
            write_record(self.root, {"script": self.script, "holds": HOLDS,
                                     "outputs": sorted({"run_args.json", *(self._adopted or ())})})
        if not names <= self.outputs():
            record_outputs(self.root, names)

    def path(self, rel: str) -> Path:
        """The folder or file `rel` inside the benchmark's folder, claimed for writing: missing (it is recorded
        before anything is written into it, so a stopped benchmark still owns it), or already the benchmark's; a
        path holding anything the benchmark did not record writing is refused."""
        owned = self.outputs()
        parts = Path(rel).parts
        for depth in range(1, len(parts) + 1):  # the folders above it too: a user's lm_eval/ is not the benchmark's
            step = "/".join(parts[:depth])
            found = self.root / step
            if step not in owned and found.exists() and not (found.is_dir() and not any(found.iterdir())):
                what = f"holds {describe_folder(found)}" if found.is_dir() else "is a file"
                raise Refused(f"{found} {what}, which {self.label} did not record writing in {self.flag} "
                              f"{self.root}; it is left as it is and nothing was written. Move it away, or pick "
                              f"another {self.flag}.")
        self._record([rel])
        return self.root / rel

    def clear(self, rel: str) -> None:
        """Delete the benchmark's earlier output `rel` (a run to redo, a model to save again) by that folder's own
        run record: the files it lists, and nothing else. A folder that also holds other files is refused."""
        target = self.path(rel)
        if not target.exists():
            return
        if not target.is_dir() or target.is_symlink():
            target.unlink()
            return
        record = read_run_record(target)
        # no record: a run or a saved model stopped before writing one (run_dir's names of such folders' files)
        owned = run_outputs(record or {})
        others = [name for name in folder_contents(target) if name not in owned]
        checkpoints = target / "checkpoints"
        if checkpoints.is_dir():
            others += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir())
                       if not CHECKPOINT_ENTRY.match(p.name)]
        if others:
            listed = ", ".join(others[:6]) + (f", ... ({len(others)} in all)" if len(others) > 6 else "")
            raise Refused(f"{target} must be redone, but it also holds files its run did not write ({listed}); "
                          "nothing was deleted. Move those files away (or the whole folder), then run the benchmark "
                          "again.")
        for name in folder_contents(target):
            path = target / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        target.rmdir()

    def saved(self, rel: str, started_from: str | None, **settings) -> None:
        """After the benchmark saved a model into `rel` itself (`save_pretrained`): run_dir's record of that folder
        (the benchmark, the model's family, what it came from), listing its files: what a redo may delete."""
        folder = self.root / rel
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        write_model_record(folder, self.script, config.get("model_type"), started_from, **settings)

    def wrote(self, rel: str, names: Iterable[str]) -> None:
        """After a script the benchmark ran wrote `names` into its folder `rel` (an evaluation's results, the model
        card): added to that folder's record, so that a redo deletes them with the rest."""
        record_outputs(self.root / rel, names)

    # -- the benchmark's records of each run (its command, its evaluation), in RECORDS/NAME_KIND.json ------------
    def record_file(self, name: str, kind: str) -> Path:
        return self.root / RECORDS / f"{name}_{kind}.json"

    def read_record(self, name: str, kind: str):
        """The record `kind` of run `name` (parsed), or None when there is none or it is not JSON."""
        text = self.record_text(name, kind)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    def record_text(self, name: str, kind: str) -> str:
        """The record as written ("" when there is none): a stamp of what a run was made of."""
        path = self.record_file(name, kind)
        return path.read_text() if path.is_file() and self.owns(RECORDS) else ""

    def write_record(self, name: str, kind: str, value, indent: int | None = None) -> None:
        self.path(RECORDS).mkdir(parents=True, exist_ok=True)
        self.record_file(name, kind).write_text(json.dumps(value, indent=indent))

    def finished(self, name: str, wanted, retrain: bool = False, marker: str = "all_results.json") -> bool:
        """Whether the benchmark's run `name` finished with the command `wanted` (and is reused, unless retrain)."""
        return (not retrain and self.owns(name) and (self.root / name / marker).is_file()
                and self.read_record(name, "command") == as_recorded(wanted))

    def start_or_resume(self, name: str, wanted, retrain: bool = False) -> list[str]:
        """Before a run of the command `wanted` into the folder `name`: the arguments that go on from an interrupted
        run of this same command (`--resume_from_checkpoint latest`: a run stopped by SIGTERM or Ctrl-C saved its
        state), or none, after clearing any other run of the benchmark's there. A folder the benchmark did not make
        is refused."""
        folder = self.path(name)
        same = self.read_record(name, "started") == as_recorded(wanted)
        if same and not retrain and has_checkpoint(folder):
            return ["--resume_from_checkpoint", "latest"]
        self.clear(name)
        self.write_record(name, "started", wanted)
        return []


def legacy_records_layout(root: Path) -> list[str] | None:
    """For a folder with no record: what the benchmarks' earlier versions wrote there with their records/ folder
    (the records, the lm_eval/ and converted/ folders, and each run a command record names), adopted as theirs; None
    when the folder is not laid out so (then it is refused)."""
    matches = [LEGACY_RECORD.match(name) for name in folder_contents(root / RECORDS)]
    if not matches or not all(matches):
        return None
    runs = {m["name"] for m in matches if m["kind"] in ("command", "started")}
    adopted = [RECORDS, *(name for name in folder_contents(root) if name in runs)]
    for sub in ("lm_eval", "converted"):
        if (root / sub).is_dir():
            adopted += [sub, *(f"{sub}/{name}" for name in folder_contents(root / sub) if (root / sub / name).is_dir())]
    return adopted


def command_writes(command: str) -> str | None:
    """The output whose folder a logged command writes (a run's `--output_dir`, a results file's folder, a
    converter's destination, a saved model's folder): which run a command in a report belongs to."""
    words = command.split()
    for flag in ("--output_dir", "--output_file"):
        if flag in words[:-1]:
            path = Path(words[words.index(flag) + 1])
            return path.parent.name if flag == "--output_file" else path.name
    if len(words) > 3 and words[0] == "-m" and words[1].startswith("attnzoo.convert."):
        return Path(words[3]).name
    if ".save_pretrained('" in command:
        return Path(command.rsplit(".save_pretrained('", 1)[1].split("'", 1)[0]).name
    return None


def reusable(names: list[str], same: Callable[[str], bool], here: Callable[[str], bool],
             needs: Callable[[str], str | None]) -> list[str]:
    """The names whose figures an earlier report of the same setup gives: those it holds the `same` way whose runs
    are not `here`, minus each computed one's `needs` (the model its weights come from: computed too)."""
    computed = [name for name in names if here(name) or not same(name)]
    for name in computed:  # appended to while walked: the chain of trained models
        start = needs(name)
        if start is not None and start not in computed:
            computed.append(start)
    return [name for name in names if name not in computed]


# -- results files --------------------------------------------------------------------------------------------
def setup_digest(setup: dict) -> str:
    return hashlib.sha256(json.dumps(as_recorded(setup), sort_keys=True).encode()).hexdigest()[:8]


def beside(path: Path, setup: dict) -> Path:
    """Where a report of `setup` goes when `path` holds the benchmark's report of another setup."""
    return path.with_name(f"{path.stem}-{setup_digest(setup)}{path.suffix}")


def json_kind(value) -> str:
    """What JSON calls the kind of `value` (for messages about a file's contents)."""
    kinds = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def read_report(path: Path, validate: Callable[[dict], None], label: str, flag: str = "--results",
                fix: str | None = None) -> dict:
    """The report in `path`, checked by `validate` (which raises ValueError saying what is wrong); a Refused naming
    the file, what is wrong (missing, a folder, not JSON, not this benchmark's report) and `fix` otherwise."""
    path = Path(path)
    fix = fix or f"Nothing was written; name a results file {label} wrote"

    def refuse(problem: str) -> Refused:
        return Refused(f"{flag} {path} {problem}. {fix}.")

    if not path.exists():
        raise refuse("does not exist")
    if path.is_dir():
        raise refuse("is a folder")
    try:
        report = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise refuse(f"is not a text file, so not a report of {label}") from None
    except ValueError as error:
        raise refuse(f"is not valid JSON ({error})") from None
    if not isinstance(report, dict):
        raise refuse(f"holds a JSON {json_kind(report)}, not a report of {label} (a JSON object)")
    try:
        validate(report)
    except ValueError as error:
        raise refuse(f"is not a report of {label}: {error}") from None
    return report


def report_target(requested: Path, setup: dict, validate: Callable[[dict], None], label: str,
                  flag: str = "--results", companions: tuple[str, ...] = (".png",),
                  setup_of: Callable[[dict], object] | None = None) -> Path:
    """Where this run's report goes, decided before anything is computed: `requested` when it is missing or holds
    this benchmark's report of the same setup (replaced); beside it (`beside`) when it holds one of another setup.
    A file that is not this benchmark's report is refused, and so is a companion file (the plot) with no report of
    the benchmark's beside it. `setup_of` (optional) reads the setup of an earlier report (default: its "setup"):
    a benchmark whose reports from before stored their setup under other names states it so, and its committed
    report is replaced by a run of the same setup instead of gaining a copy beside it."""
    requested = Path(requested)
    for target in (requested, beside(requested, setup)):
        if target.exists():
            earlier = read_report(target, validate, label, flag, fix=f"It is left as it is and nothing was "
                                                                  f"written: name another {flag} (or move that file "
                                                                  "away)")
            stated = earlier.get("setup") if setup_of is None else setup_of(earlier)
            if stated != as_recorded(setup):
                continue  # the benchmark's report of another setup: kept, this one goes beside it
        for suffix in companions:
            companion = target.with_suffix(suffix)
            if companion.exists() and not target.exists():
                raise Refused(f"{companion} exists with no report of {label} at {target} beside it; the benchmark "
                              f"would draw over it. It is left as it is and nothing was written: name another "
                              f"{flag} (or move that file away).")
        return target
    raise Refused(f"{requested} and {beside(requested, setup)} both hold reports of {label} with other setups; "
                  f"nothing was written: name another {flag}.")


def write_report(path: Path, report: dict, indent: int = 1) -> None:
    """Write the report whole or not at all (a stopped run leaves the previous version, never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=indent))
    partial.replace(path)


def publishes_tables(path: Path, committed: Path) -> bool:
    """Whether a report at `path` is the committed one, the only report the README and docs tables are rendered
    from."""
    return Path(path).resolve() == Path(committed).resolve()


def require_keys(*keys: str, benchmark: str | None = None) -> Callable[[dict], None]:
    """A report check for a benchmark whose report is an object with `keys` (the least that makes it its own, for
    reports from before they were marked) and, when marked, the mark `benchmark`."""
    def validate(report: dict) -> None:
        if benchmark is not None and report.get("benchmark", benchmark) != benchmark:
            raise ValueError(f"it is marked as a report of {report['benchmark']!r}")
        missing = [key for key in keys if key not in report]
        if missing:
            raise ValueError(f"it has no {', '.join(repr(k) for k in missing)} (a report has {', '.join(keys)})")
    return validate
