"""trainer.compilation_cache: where the entry points keep compiled programs between runs, and how it is switched."""

import importlib
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jppo.config import ConfigError, load_config
from jppo.parallel import compile_cache
from jppo.parallel.compile_cache import CacheChoice, choose

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_KEYS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture
def restored_jax_cache():
    """The test session's own cache settings (tests/conftest.py), put back after a test changes them."""
    saved = {key: getattr(jax.config, key) for key in JAX_KEYS}
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    jax_cache.reset_cache()  # the next compilation opens the session's folder again


def test_auto_is_the_users_cache_folder_unless_jax_has_one():
    assert choose("auto", None, {"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}) == CacheChoice(
        True, pathlib.Path("/x/cache/jppo/xla"))
    for environ in ({"HOME": "/home/u"}, {"XDG_CACHE_HOME": "", "HOME": "/home/u"}):
        assert choose("auto", None, environ) == CacheChoice(True, pathlib.Path("/home/u/.cache/jppo/xla"))
    # a folder JAX was given (JAX_COMPILATION_CACHE_DIR, or the program's own setting) is left as configured
    assert choose("auto", "/elsewhere", {"HOME": "/home/u"}) == CacheChoice(True, None)


def test_off_and_an_explicit_folder_win_over_jax_s_setting(tmp_path):
    assert choose("off", "/elsewhere", {"HOME": "/home/u"}) == CacheChoice(False, None)
    assert choose(str(tmp_path / "xla"), "/elsewhere", {}) == CacheChoice(True, tmp_path / "xla")
    assert choose("~/xla", None, {}).folder == pathlib.Path("~/xla").expanduser()


def test_a_chosen_folder_caches_even_a_program_that_compiles_at_once(tmp_path, restored_jax_cache):
    folder = tmp_path / "xla"
    assert compile_cache.apply(str(folder)) == str(folder)
    jax_cache.reset_cache()  # this session already compiled into its own folder
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125)(jnp.arange(7.0)).block_until_ready()  # milliseconds to compile
    assert [entry for entry in folder.iterdir() if entry.name.startswith("jit_")]


def test_off_turns_jax_s_cache_off(restored_jax_cache):
    assert compile_cache.apply("off") is None
    assert not jax.config.jax_enable_compilation_cache


def test_auto_leaves_a_configured_jax_cache_alone(restored_jax_cache):
    before = {key: getattr(jax.config, key) for key in JAX_KEYS}
    assert before["jax_compilation_cache_dir"]  # conftest.py configures the session's folder
    assert compile_cache.apply("auto") == before["jax_compilation_cache_dir"]
    assert {key: getattr(jax.config, key) for key in JAX_KEYS} == before


@pytest.mark.parametrize("written", ["off", "false", "no", "'off'"])
def test_off_written_on_the_command_line_is_off_not_a_folder(written):
    """YAML reads an unquoted ``off`` as the boolean false, which the string key holds as ``"False"``."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"trainer.compilation_cache={written}"])
    assert choose(cfg.trainer.compilation_cache, "/elsewhere", {"HOME": "/home/u"}) == CacheChoice(False, None)


@pytest.mark.parametrize("written", ["none", "null", "None", "NULL", "'null'", "' Off '"])
def test_none_and_null_are_off_not_a_folder(written, monkeypatch, tmp_path, restored_jax_cache):
    """``none`` / ``null`` (YAML's null among them) switch the cache off, as ``off`` does: no folder of that name
    appears in the working directory."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"trainer.compilation_cache={written}"])
    assert compile_cache.apply(cfg.trainer.compilation_cache) is None
    assert not jax.config.jax_enable_compilation_cache
    jax.jit(lambda x: jnp.cos(x) * 1.75 - 0.5)(jnp.arange(5.0)).block_until_ready()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["xla", "./xla", "runs/xla", "none/xla"])
def test_a_relative_folder_is_refused_before_anything_runs(value, monkeypatch, tmp_path, capsys):
    """A relative folder would be created in whichever directory the command ran from: the CLI refuses it in one
    line, exit status 2, and creates nothing."""
    from jppo import train

    monkeypatch.chdir(tmp_path)
    status = train.main([
        "--config", str(ROOT / "configs" / "quickstart.yaml"), f"trainer.compilation_cache={value}",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=1", "trainer.resume=never",
    ])
    err = capsys.readouterr().err
    assert status == 2 and err == (
        f"jppo.train: error: trainer.compilation_cache={value!r} is invalid: it must be 'auto', 'off' or an absolute "
        "local folder (~/... allowed)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_config_key_defaults_to_auto_and_accepts_a_folder(tmp_path):
    assert load_config(ROOT / "configs" / "quickstart.yaml").trainer.compilation_cache == "auto"
    for value in ("off", str(tmp_path / "new" / "xla")):
        assert load_config(ROOT / "configs" / "quickstart.yaml", [f"trainer.compilation_cache={value}"])


@pytest.mark.parametrize(
    "value, message",
    [
        ("' '", "trainer.compilation_cache=' ' is invalid: it must be 'auto', 'off' or an absolute local folder"),
        ("gs://bucket/xla", "trainer.compilation_cache='gs://bucket/xla' is invalid: it must be 'auto', 'off' or an "
                            "absolute local folder"),
        (f"{ROOT}/configs/quickstart.yaml/xla", f"trainer.compilation_cache='{ROOT}/configs/quickstart.yaml/xla': "),
    ],
)
def test_a_bad_value_is_a_one_line_config_error(value, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "quickstart.yaml", [f"trainer.compilation_cache={value}"])
    assert message in str(error.value) and "\n" not in str(error.value)


class _Started(Exception):
    """Raised by the stand-in ``apply``: the entry point got as far as configuring the cache."""


@pytest.mark.parametrize("entry", ["jppo.train", "jppo.eval"])
def test_the_entry_points_configure_the_cache_from_the_config(entry, monkeypatch, tmp_path):
    seen = []

    def record(setting):
        seen.append(setting)
        raise _Started

    monkeypatch.setattr(compile_cache, "apply", record)
    with pytest.raises(_Started):
        importlib.import_module(entry).main([
            "--config", str(ROOT / "configs" / "quickstart.yaml"), f"trainer.compilation_cache={tmp_path / 'xla'}",
            f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=1", "trainer.resume=never",
            "trainer.logger=[jsonl]", "trainer.plots=false",
        ])
    assert seen == [str(tmp_path / "xla")]
