"""The pages run as written: every command of a fenced ``bash`` block of README.md and docs/ is extracted and
checked, and every number a page quotes as measured is the generated file's (``docs/measured/numbers.json``,
written by ``python -m bench.numbers.docs_numbers``).

How each command is checked (:data:`HOW`; a command no rule covers fails the test, so a page cannot gain an
unchecked command):

- ``run``: runs in this process, in one shared folder (``configs`` linked in), so what one command writes the next
  reads (the quickstart's run folder for ``eval``, ``export`` and ``plot``); a training run gets :data:`SHORT`
  appended (one step, one checkpoint: the pages' ``trainer.total_steps=50``-style override; a training command
  whose config is an earlier one's but for the output folder is loaded and checked, not trained again), an
  evaluation a few held-out prompts;
- ``mesh``: a command only a GPU or TPU host runs (a GSM8K run of Qwen2.5-0.5B), or one that starts vLLM servers
  (tests/test_vllm_servers.py trains on one): its arguments parsed, its config
  loaded (against a stand-in checkpoint of Qwen2.5-0.5B's shape in a Hugging Face cache) and its mesh checked on 1
  and on 8 devices, the hardware the pages name;
- ``parse``: a command of placeholders (``CONFIG``, ``NODE0``): its arguments parsed;
- ``dry-run``: the TPU scripts with ``--dry-run`` (they print the gcloud commands they would run);
- ``help``: a tool the suite does not run (``hf download``, which needs the network): ``--help`` exits 0, so the
  command exists as the page spells it;
- ``setup``: installs and environments (``pip``, ``uv``, a venv, ``pytest``): what the suite itself runs in.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from bench.numbers import docs_numbers
from bench.numbers.plan_table import MODELS, write_checkpoints
from jppo import cli
from jppo.config import ConfigError, check_mesh
from jppo.preflight import targets

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
# one training step, saved, no validation or plots: what every `run` training command gets appended
SHORT = ["trainer.total_steps=1", "trainer.save_every=1", "trainer.val_every=0", "trainer.plots=false",
         "trainer.progress_bar=false"]
SHORT_EVAL = ["data.num_val_examples=8", "data.val_batch_size=8"]
GPU_ONLY = ("qwen2_5_0_5b_gsm8k", "qwen3_30b_a3b_gsm8k")  # configs of a real-size model: `mesh`, never `run`
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"

HOW = [  # (pattern on the command, how it is checked), first match wins
    (r"^(pip|uv|python3\.12 -m venv|/work/venv312/|\. /work/venv312/|pytest)\b", "setup"),
    (r"^hf download ", "help"),
    (r"^tpu_scripts/\w+\.sh ", "dry-run"),
    (r"^python -m jppo\.\w+ .*\b[A-Z][A-Z0-9]+\b(?!\.)", "parse"),  # a placeholder in capitals
    (r"^python -m jppo\.serve ", "parse"),  # a server runs until killed (tests/test_vllm_servers.py starts them)
    # vLLM on servers of its own: a server's start is ~20 s of the suite's budget, and tests/test_vllm_servers.py
    # trains on one (its config is checked here: rollout.devices resolved to servers, the mesh on 1 and 8 devices)
    (r"^python -m jppo\.train .*rollout\.engine=vllm .*rollout\.devices=", "mesh"),
    (r"^python -m jppo\.(train|eval|plan|audit) .*(" + "|".join(GPU_ONLY) + ")", "mesh"),
    (r"^python -m jppo\.audit ", "mesh"),  # minutes of compiling: tests/test_audit.py runs the audit
    (r"^python -m jppo\.export runs/(" + "|".join(GPU_ONLY) + ")", "parse"),  # the run the GPU would have written
    (r"^python -m (jppo\.[\w.]+|bench\.run) ", "run"),
]


def commands(text: str) -> list[list[str]]:
    """The commands of a page's ``bash`` blocks as argument lists: continuation lines joined, comments dropped,
    ``&&`` splitting two commands, ``NAME=value`` assignments applied to the ``$NAME`` of later lines of the page
    (and dropped), a command's own leading ``NAME=value`` environment dropped."""
    out, variables = [], {}
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            assignment = re.fullmatch(r"([A-Z_]+)=(.*)", words[0])
            if assignment and len(words) == 1:
                variables[assignment[1]] = re.sub(r"\$(\w+)", lambda m: variables.get(m[1], m[0]), assignment[2])
                continue
            while len(words) > 1 and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # `CUDA_VISIBLE_DEVICES=7 python ...`:
                words = words[1:]  # the command's own environment, which the checks do not need
            expanded = [[]]
            for word in words:
                if word == "&&":  # `pip install -e . && python -m jppo.train ...`: two commands
                    expanded.append([])
                elif re.fullmatch(r"\$\w+", word) and word[1:] in variables:
                    expanded[-1] += variables[word[1:]].split()
                else:
                    expanded[-1].append(word)
            out += expanded
    return out


def optional_removed(words: list[str]) -> list[str]:
    """A usage line's ``[--step N]`` parts removed (the page shows what may be added)."""
    return shlex.split(re.sub(r"\[[^\]]*\]", "", shlex.join(words)).replace("'", ""))


def how(words: list[str]) -> str | None:
    line = " ".join(words)
    return next((kind for pattern, kind in HOW if re.search(pattern, line)), None)


def page_commands() -> list[tuple[str, list[str]]]:
    return [(page.relative_to(ROOT).as_posix(), words) for page in PAGES for words in commands(page.read_text())]


def test_every_command_of_the_pages_is_checked_by_one_rule():
    unchecked = [(page, " ".join(words)) for page, words in page_commands() if how(words) is None]
    assert not unchecked, f"commands no rule of tests/test_docs.py checks: {unchecked}"
    ran = {how(words) for _, words in page_commands()}
    assert ran == {"setup", "help", "dry-run", "parse", "mesh", "run"}, ran


def test_the_pages_quote_the_generated_numbers():
    """Every ``<!--m:KEY-->VALUE`` of a page is the value of KEY in docs/measured/numbers.json."""
    numbers = json.loads(docs_numbers.NUMBERS.read_text())["numbers"]
    quoted = {(path.relative_to(ROOT).as_posix(), key, value)
              for path in docs_numbers.page_paths() for key, value in docs_numbers.quoted(path.read_text())}
    assert len(quoted) >= 20, quoted  # the quickstart, DAPO and one-device plan numbers, at least
    wrong = [(page, key, value, numbers.get(key)) for page, key, value in quoted if numbers.get(key) != value]
    assert not wrong, f"pages quoting other numbers than docs/measured/numbers.json (page, key, quoted, file): {wrong}"


def test_pages_are_rewritten_from_the_file_at_their_markers_only():
    text = "from <!--m:a.b-->0.12 to <!--m:a.c-->97% (0.12 unmarked), <!--m:x.y-->-0.03 kept"
    assert docs_numbers.quoted(text) == [("a.b", "0.12"), ("a.c", "97%"), ("x.y", "-0.03")]
    assert docs_numbers.rewrite(text, {"a.b": "0.15", "a.c": "88%"}) == (
        "from <!--m:a.b-->0.15 to <!--m:a.c-->88% (0.12 unmarked), <!--m:x.y-->-0.03 kept")


def test_the_generated_plan_numbers_are_what_the_plan_says_now():
    """The planned numbers cost no run: a change to the plan that moves them must regenerate the file (and so the
    pages, `python -m bench.numbers.docs_numbers --only plan --pages`)."""
    numbers = json.loads(docs_numbers.NUMBERS.read_text())["numbers"]
    planned = docs_numbers.plan_numbers()
    assert planned == {key: numbers.get(key) for key in planned}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The folder the pages' commands run in: ``configs`` linked, a Hugging Face cache holding a stand-in
    ``Qwen/Qwen2.5-0.5B-Instruct`` (its ``config.json``: all a config check reads), and stand-ins of the GSM8K
    parquet files the pages convert."""
    import pyarrow
    import pyarrow.parquet

    work = tmp_path_factory.mktemp("docs")
    (work / "configs").symlink_to(ROOT / "configs")
    shapes = write_checkpoints(work / "shapes")
    repo = work / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    (repo / "snapshots" / SNAPSHOT).mkdir(parents=True)
    shutil.copy(shapes[next(iter(MODELS))] / "config.json", repo / "snapshots" / SNAPSHOT / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    rows = [{"question": f"What is {n} + {n}?", "answer": f"{n} + {n} = {2 * n}\n#### {2 * n}"} for n in range(4)]
    (work / "gsm8k").mkdir()
    (work / "data" / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        table = pyarrow.Table.from_pylist(rows)
        pyarrow.parquet.write_table(table, str(work / "gsm8k" / f"{split}-00000-of-00001.parquet"))
        # README's GSM8K runs come before docs/huggingface.md's conversion, which writes these again
        (work / "data" / "gsm8k" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": row["question"], "answer": row["answer"]}) + "\n" for row in rows))
    return work


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return workdir


def module_main(words: list[str]):
    assert words[:2] == ["python", "-m"], words
    return importlib.import_module(words[2]), words[3:]


def run(words: list[str], trained: list) -> None:
    """``trained``: the configs (output folder blanked) of the training commands run so far, of every page."""
    module, argv = module_main(optional_removed(words))
    name = module.__name__
    # an output folder outside the run's own (running.md's /tmp/qs312) goes into the shared folder
    argv = [re.sub(r"^trainer\.output_dir=/.*/", "trainer.output_dir=", word) for word in argv]
    if name in ("jppo.train", "jppo.sft"):
        argv = [*argv, *SHORT]
        # a page's command that trains what an earlier one trained (its config checked here, equal but for the
        # output folder: the same step count once SHORT is appended) would only compile and run that step again
        cfg = cli.load_config(module.parse_args(argv), sft=name == "jppo.sft")
        run_of = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=""))
        if run_of in trained:
            return
        trained.append(run_of)
    elif name == "jppo.eval":
        argv = [*argv, *SHORT_EVAL]
    elif name == "jppo.audit":
        argv = [*argv, "--meshes", "1x1x1x1", "--quick"]
    elif name == "bench.run":
        argv = ["--help"]  # a benchmark's own run is not the docs' to time
    try:
        status = module.main(argv)
    except SystemExit as exit_:  # --help
        status = exit_.code
    assert status in (0, None), f"{' '.join(words)} exited {status}"


def mesh(words: list[str]) -> None:
    """Parsed, its config loaded and its mesh checked on 1 and 8 devices; a ``trainer.resume`` of the GPU's run
    (which this machine never wrote) left out."""
    module, argv = module_main(words)
    argv = [word for word in argv if not re.match(r"trainer\.resume=runs/(" + "|".join(GPU_ONLY) + ")", word)]
    # compiling for a target reads the model's config.json, never the prompt files (tests/test_compile_for.py
    # compiles): the page's model folder is the workdir's folder of Qwen2.5-0.5B's shape
    compile_for = getattr(module.parse_args(argv), "compile_for", None)
    data_files = compile_for is None
    if not data_files:
        argv = [re.sub(r"^model\.path=/data/qwen2\.5-0\.5b-instruct$", "model.path=shapes/Qwen2.5-0.5B", word)
                for word in argv]
    try:
        cfg = cli.load_config(module.parse_args(argv), data_files)
    except ConfigError as error:
        # without vLLM installed (CI installs its CPU build) the line is refused for that alone: the rest is checked
        if "rollout.engine='vllm' needs vLLM" not in str(error) or importlib.util.find_spec("vllm") is not None:
            raise
        cfg = cli.load_config(module.parse_args([word for word in argv if word != "rollout.engine=vllm"]), data_files)
    counts = (1, 8) if compile_for is None else (len(targets.target(compile_for).devices),)  # the target's chips
    for devices in counts:
        if "--sft" in argv:  # the audit of python -m jppo.sft's update: its mesh and batch checks
            from jppo.run import sft

            sft.mesh_shape(sft.sft_config(cfg), devices)
        else:
            check_mesh(cfg, devices)


def parse(words: list[str]) -> None:
    """Parsed, a one-letter placeholder (``N``, ``I``) read as 1."""
    module, argv = module_main(optional_removed(words))
    module.parse_args(["1" if re.fullmatch(r"[A-Z]", word) else word for word in argv])


def dry_run(words: list[str]) -> None:
    script, *rest = words
    result = subprocess.run(["bash", str(ROOT / script), "--dry-run", *rest], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, (words, result.stderr)


def help_exits_0(words: list[str]) -> None:
    tool = shutil.which(words[0], path=os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ["PATH"]]))
    assert tool, f"{words[0]} is not installed"
    result = subprocess.run([tool, words[1], "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (words, result.stderr)


CHECKS = {"run": run, "mesh": mesh, "parse": parse, "dry-run": dry_run, "help": help_exits_0, "setup": None}


def test_every_command_of_the_pages_works_as_written(in_workdir, capsys):
    """The pages' commands in page order (README.md first), each as :data:`HOW` says."""
    failed, checks = [], {**CHECKS, "run": functools.partial(run, trained=[])}
    for page, words in page_commands():
        check = checks[how(words)]
        if check is None:
            continue
        try:
            check(words)
        except BaseException as error:  # noqa: BLE001 (every failing command is reported, not only the first)
            failed.append(f"{page}: {' '.join(words)}: {type(error).__name__}: {error}")
    capsys.readouterr()
    assert not failed, "\n".join(failed)
