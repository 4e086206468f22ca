"""Messages that send the user the right way: what they suggest is what the docs say and what the config has not
done yet."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from jppo import plan
from jppo.config import ConfigError, load_config
from jppo.core.errors import InvalidSetting
from jppo.preflight.audit_cuts import parse_meshes
from jppo.rollout import vllm_engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
GRPO = ROOT / "configs" / "quickstart_grpo.yaml"
DEVICE_FLAG = "XLA_FLAGS=--xla_force_host_platform_device_count=8"


def test_without_vllm_the_error_gives_the_readme_s_uv_command(monkeypatch):
    """The README installs vLLM's CPU build with uv (pip's resolver runs for tens of minutes on it): the error
    gives that command as the README writes it, not pip's."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, whatever this machine has
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    uv = re.search(r"uv pip install --find-links .*?torchcodec", readme).group(0)
    with pytest.raises(ConfigError) as error:
        load_config(GRPO, ["rollout.engine=vllm"])
    message = str(error.value)
    assert message == f"rollout.engine='vllm' needs vLLM: {vllm_engine.INSTALL}; or rollout.engine=jppo"
    assert " ".join(uv.split()) in message and "jppo[vllm-cpu]" not in message


def test_the_plan_s_out_of_memory_warning_suggests_remat_only_when_it_is_off(tmp_path, capsys):
    args = ["--config", str(QUICKSTART), "--devices", "1", "--device-memory", "0.0001",
            f"trainer.output_dir={tmp_path / 'run'}", "mesh.data=1"]
    warnings = {}
    for remat in (False, True):
        assert plan.main([*args, f"model.remat={str(remat).lower()}"]) == 0
        warnings[remat] = capsys.readouterr().err
    assert warnings[False].count("\n") == 1 and warnings[False].strip().endswith("or turn on model.remat")
    assert warnings[True].count("\n") == 1 and "turn on model.remat" not in warnings[True]
    assert warnings[True].strip().endswith("(model.remat is already on)")


def test_audit_meshes_beyond_this_machine_name_the_device_simulation_flag():
    with pytest.raises(InvalidSetting) as error:
        parse_meshes("2x1x1x1", 1, 8)
    message = str(error.value)
    assert "of at most 1 device whose" in message and DEVICE_FLAG in message
