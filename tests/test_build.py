"""``jppo.run.build``: models built from a checkpoint take the config's own settings."""

import pathlib

from jppo.config import load_config
from jppo.models import CausalLM, ModelConfig, create_model, save_pretrained
from jppo.parallel.mesh import make_mesh
from jppo.run import build

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def test_a_checkpoint_policy_and_critic_take_model_remat_and_model_attention(tmp_path):
    tiny = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       model_type="qwen2")
    save_pretrained(create_model(CausalLM, tiny), tmp_path / "model")
    cfg = load_config(QUICKSTART, [f"model.path={tmp_path / 'model'}", "model.tokenizer=builtin:reverse_digits",
                                   "model.remat=true", "model.attention=xla", f"trainer.output_dir={tmp_path / 'run'}"])
    mesh = make_mesh(devices=make_mesh().devices.flat[:1])

    policy = build.build_policy(cfg, None, mesh)

    critic = build.build_critic(cfg, policy, mesh)
    assert policy.config.remat and critic.config.remat
    assert policy.config.attention == critic.config.attention == "xla"
