"""The commands apart from the library: one plumbing for all of them (``jppo/cli.py``), no module of the package
importing a command, and one model-building sequence (:func:`jppo.run.build.models`) behind every command."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jppo.config import CONFIG_HELP, load_config
from jppo.parallel.mesh import make_mesh
from jppo.run import build

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
QUICKSTART_LORA = ROOT / "configs" / "quickstart_lora.yaml"
COMMANDS = ("train", "sft", "eval", "audit", "export", "plan", "plot")
CONFIG_COMMANDS = ("train", "sft", "eval", "audit", "plan")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every ``jppo`` module ``path`` imports, at module level or inside a function (``from jppo import train``
    counts as ``jppo.train``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "jppo"}


def test_no_module_of_the_package_imports_a_command():
    """The commands sit on top: the library, and the commands themselves, import none of them; ``jppo.cli`` is the
    commands' own."""
    commands = {f"jppo.{command}" for command in COMMANDS}
    offenders = {}
    for path in sorted((ROOT / "jppo").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        forbidden = commands | (set() if module in commands else {"jppo.cli"})
        found = imported_modules(path) & forbidden
        if found:
            offenders[module] = sorted(found)
    assert not offenders, offenders


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_every_command_of_a_config_takes_the_same_config_argument(command, capsys):
    with pytest.raises(SystemExit) as exit_status:
        importlib.import_module(f"jppo.{command}").parse_args(["--help"])
    assert exit_status.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: python -m jppo.{command} " in out and "overrides" in out
    assert "".join(CONFIG_HELP.split()) in "".join(out.split()), out  # argparse wraps lines (and at hyphens)


@pytest.mark.parametrize(
    "command,argv,expected",
    [("train", ["--config", "C", "a.b=1", "--num-processes", "2", "c.d=2", "--process-id", "1", "e.f=3"],
      {"config": "C", "overrides": ["a.b=1", "c.d=2", "e.f=3"], "num_processes": 2, "process_id": 1}),
     ("sft", ["--config", "C", "a.b=1", "--num-processes", "2", "c.d=2"],
      {"config": "C", "overrides": ["a.b=1", "c.d=2"], "num_processes": 2}),
     ("eval", ["a.b=1", "--out", "O", "c.d=2", "--config", "C"],
      {"config": "C", "out": "O", "overrides": ["a.b=1", "c.d=2"]}),
     ("audit", ["--config", "C", "a.b=1", "--quick", "c.d=2"], {"quick": True, "overrides": ["a.b=1", "c.d=2"]}),
     ("plan", ["--config", "C", "a.b=1", "c.d=2", "--devices", "8", "mesh.fsdp=8"],
      {"devices": 8, "overrides": ["a.b=1", "c.d=2", "mesh.fsdp=8"]}),
     ("export", ["RUN", "--adapters", "OUT", "--step", "3"],
      {"source": "RUN", "out": "OUT", "adapters": True, "step": 3})],
)
def test_every_command_takes_its_positionals_on_either_side_of_a_flag(command, argv, expected):
    """``--config C $ARGS --devices 8 mesh.fsdp=8``: overrides (and export's RUN OUT) split around a flag are all
    taken, in order, where plain argparse refuses the second run as unrecognized arguments."""
    args = importlib.import_module(f"jppo.{command}").parse_args(argv)
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize(
    "command,argv,message",
    [(command, ["--config", str(QUICKSTART), "actor.ppo_epoch=2"], "actor.ppo_epoch") for command in CONFIG_COMMANDS]
    + [("export", ["/nonexistent/run", "/nonexistent/out"], "'/nonexistent/run' is neither a run directory"),
       ("plot", ["/nonexistent/run"], "run directory '/nonexistent/run' does not exist")],
)
def test_a_bad_input_is_one_line_and_exit_status_2_for_every_command(command, argv, message, capsys):
    status = importlib.import_module(f"jppo.{command}").main(argv)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"jppo.{command}: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


def test_the_plot_command_starts_without_jax():
    """``python -m jppo.plot`` reads a file and draws: the shared plumbing loads neither JAX nor the config."""
    probe = ("import sys; import jppo.plot; "
             "print(sorted(m for m in ('jax', 'flax', 'jppo.config') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def leaves_equal(a, b) -> bool:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) > 0 and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def test_training_and_the_audit_build_the_same_models_and_an_actor_alone_is_the_same_actor(tmp_path):
    """LoRA on both roles and a KL reference: the trainer's models (``setup``), the audit's and the export's
    actor (``roles=("actor",)``, no reference) come out of :func:`build.models` with the same arrays; the seed
    decides the random weights of both roles."""
    from jppo.preflight.audit import build_roles
    from jppo.run.loop import setup

    cfg = load_config(QUICKSTART_LORA, [
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
        "trainer.val_every=0", "actor.use_kl_loss=true", "critic.lora.rank=4", "mesh.data=1",
        f"trainer.output_dir={tmp_path}",
    ])
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    inputs = build.load_inputs(cfg)
    state, _, _, _ = setup(cfg, mesh, inputs)
    roles = {role.name: role for role in build_roles(cfg, inputs)}
    for name, trained in (("actor", state.actor), ("critic", state.critic)):
        assert leaves_equal(roles[name].params, trained.params), name
        assert leaves_equal(roles[name].frozen, trained.frozen), name
    actor_only = build.models(cfg, inputs.tokenizer, mesh, roles=("actor",), reference=False)
    assert actor_only.critic is None and actor_only.reference is None and actor_only.base is not None
    assert leaves_equal(actor_only.actor.params, state.actor.params)
    assert leaves_equal(actor_only.actor.frozen, state.actor.frozen)
    other_seed = build.models(cfg, inputs.tokenizer, mesh, seed=cfg.trainer.seed + 1)
    assert not leaves_equal(other_seed.actor.params, state.actor.params)
    assert not leaves_equal(other_seed.critic.params, state.critic.params)


def test_a_command_logs_the_xla_environment_it_started_with(monkeypatch, caplog):
    from jppo import cli  # noqa: PLC0415

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    args = cli.parse_args(["--config", str(QUICKSTART), "trainer.compilation_cache=off"], "train", "t",
                          overrides="o", processes=True)
    with caplog.at_level("INFO", logger="jppo.train"):
        cli.start("train", cli.load_config(args), args)
    logged = [record.getMessage() for record in caplog.records if record.name == "jppo.train"]
    assert "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true" in logged
    assert "LIBTPU_INIT_ARGS=(unset)" in logged


def test_every_command_runs_the_components_checks_before_it_compiles():
    """The components register their config checks (jppo.core.checks) and ``jppo.config`` alone loads none of
    them: every command of a config reads it through ``cli.load_config``, which loads them all first (export reads
    a run's config through jppo.run.export, which loads jppo.run.build, which loads them too). In a fresh process,
    a value only a component's registered check refuses (a policy loss no module registered) ends the command in one
    line, status 2."""
    for command in CONFIG_COMMANDS:
        source = (ROOT / "jppo" / f"{command}.py").read_text()
        others = source.replace("cli.load_config(", "")
        assert "cli.load_config(args" in source and "load_config(" not in others, command
    assert "jppo.run.build" in imported_modules(ROOT / "jppo" / "run" / "export.py")
    assert "jppo.run.checks" in imported_modules(ROOT / "jppo" / "run" / "build.py")
    result = subprocess.run([sys.executable, "-m", "jppo.plan", "--config", str(QUICKSTART), "actor.policy_loss=nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "jppo.plan: error: actor.policy_loss='nope' is not valid; valid: cispo, dppo_kl, dppo_tv, dro, geo_mean, gpg, "
        "gspo, sapo, vanilla"]


def test_a_config_loaded_before_the_components_is_checked_by_them_before_anything_is_built(tmp_path):
    """A program that reads its config with ``jppo.config`` alone gets the config layer's checks; the components'
    (here the policy loss's name) run when it builds the run's models, before anything compiles."""
    code = (
        "import jppo.config\n"
        f"cfg = jppo.config.load_config({str(QUICKSTART)!r}, ['actor.policy_loss=nope', "
        f"'trainer.output_dir={tmp_path / 'run'}'])\n"
        "from jppo.run import build\n"
        "try:\n    build.models(cfg, None, None)\n"
        "except jppo.config.ConfigError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == ("actor.policy_loss='nope' is not valid; valid: cispo, dppo_kl, dppo_tv, dro, "
                                   "geo_mean, gpg, gspo, sapo, vanilla"), done.stderr
