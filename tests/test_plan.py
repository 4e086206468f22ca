"""``jppo.plan``: the memory plan agrees with what the trainer builds, and scales with the rows per device."""

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jppo import plan
from jppo.config import check_mesh, load_config, views
from jppo.config.views import engine_view
from jppo.engine import init_train_state
from jppo.parallel.mesh import MESH_AXES, make_mesh
from jppo.preflight import footprint, layout_copies, memory, sampler_memory
from jppo.run import build

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
TOOLS = QUICKSTART.parent / "quickstart_tools.yaml"


def quickstart(tmp_path, *overrides):
    return load_config(QUICKSTART, [f"trainer.output_dir={tmp_path / 'run'}", *overrides])


def device_bytes(tree, per_parameter_only: bool = False) -> int:
    """Bytes that the first device holds of every array of ``tree`` (scalar counters left out on request)."""
    leaves = [x for x in jax.tree.leaves(tree) if not (per_parameter_only and x.ndim == 0)]
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


@pytest.mark.parametrize("mesh_overrides", [("mesh.data=8",), ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")])
def test_parameter_and_optimizer_bytes_equal_the_built_ones(tmp_path, mesh_overrides):
    cfg = quickstart(tmp_path, *mesh_overrides)
    shape = check_mesh(cfg, 8)
    mesh = make_mesh(*shape)
    tokenizer = build.load_inputs(cfg).tokenizer
    policy = build.build_policy(cfg, tokenizer, mesh)
    critic = build.build_critic(cfg, policy, mesh)
    actor_params, critic_params = nnx.state(policy, nnx.Param), nnx.state(critic, nnx.Param)
    actor_state = init_train_state(actor_params, engine_view(cfg, "actor"), mesh)
    critic_state = init_train_state(critic_params, engine_view(cfg, "critic"), mesh)

    planned = memory.memory_plan(cfg, shape)

    assert planned.term("parameters/actor") == device_bytes(actor_params)
    assert planned.term("parameters/critic") == device_bytes(critic_params)
    assert planned.term("optimizer_state/actor") == device_bytes(actor_state.opt_state, per_parameter_only=True)
    assert planned.term("optimizer_state/critic") == device_bytes(critic_state.opt_state, per_parameter_only=True)


def sampler_cache_bytes(cfg, prompt_tokens: int) -> int:
    """Bytes of the keys and values the trainer's training sampler holds on one device for a batch of the longest
    prompts it can be given (``prompt_tokens`` tokens each): the sampler the Collector builds, running the policy in
    ``rollout.dtype`` as train.py sets it up, fed the prompts padded as its ``Sampler`` pads them, and the caches of
    the sampler's own prefill and response-cache functions, as shapes (nothing is computed)."""
    from jppo.rollout import decode as sampling
    from jppo.rollout.sampler import pad_prompts
    from jppo.run.collect import Collector

    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    inputs = build.load_inputs(cfg)
    policy = nnx.eval_shape(lambda: build.CausalLM(views.random_model_config(cfg, inputs.tokenizer), rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(policy, nnx.Param)
    collector = Collector.create(cfg, mesh, inputs, graphdef, None, None, sampling=build.sampling_graphdef(cfg, policy))
    # a multi-turn rollout calls its one-sample sampler on every row's own context, train_batch_size x n of them
    multi_turn = cfg.rollout.env is not None
    sampler = collector.sampler.sampler if multi_turn else collector.sampler
    contexts = cfg.data.train_batch_size * (cfg.rollout.n if multi_turn else 1)
    ids, mask = pad_prompts([[1] * prompt_tokens] * contexts, inputs.tokenizer.pad_id,
                            multiple=cfg.rollout.prompt_bucket)

    def caches(params, ids, mask):
        model = nnx.merge(build.sampling_graphdef(cfg, policy), params)
        prompt, _, _ = sampling.prefill(model, ids, mask)
        return prompt, sampling.response_cache(model, len(ids) * sampler.params.n, sampler.params)

    shapes = jax.eval_shape(caches, params, jnp.asarray(ids), jnp.asarray(mask))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


SMALL_BATCH = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
               "trainer.val_every=0", "mesh.data=1")


@pytest.mark.parametrize("config, overrides", [
    (QUICKSTART, ("rollout.n=2",)),
    (QUICKSTART, ("rollout.n=2", "model.dtype=float32", "rollout.dtype=bfloat16")),
    (QUICKSTART, ("rollout.n=2", "rollout.max_num_seqs=4")),  # 16 rows, 4 decoded at once
    (TOOLS, ()),  # rollout.env: 8 prompts x 4 rows, each row's context prefilled on its own
    (TOOLS, ("rollout.max_num_seqs=8",)),
], ids=["default", "bfloat16-rollout", "continuous-batching", "multi-turn", "multi-turn-continuous"])
def test_kv_cache_term_equals_the_sampler_caches(tmp_path, config, overrides):
    cfg = load_config(config, [f"trainer.output_dir={tmp_path / 'run'}", *SMALL_BATCH, *overrides])
    # the longest prompt the sampler is given: data.max_prompt_length, or in a multi-turn rollout a context that
    # holds every response slot but the last (a row with no slot left takes no more turns)
    longest = cfg.data.max_prompt_length
    if cfg.rollout.env is not None:
        longest += cfg.rollout.max_response_length - 1

    planned = memory.memory_plan(cfg, check_mesh(cfg, 1))

    assert planned.term("kv_cache") == sampler_cache_bytes(cfg, longest)


@pytest.mark.parametrize("remat", [False, True])
def test_half_the_rows_per_device_halves_activations_and_kv_cache(tmp_path, remat):
    common = [f"model.remat={remat}", "actor.ppo_mini_batch_size=128", "critic.ppo_mini_batch_size=128"]
    two = quickstart(tmp_path, *common, "mesh.data=2", "actor.ppo_micro_batch_size=8", "critic.ppo_micro_batch_size=8")
    four = quickstart(tmp_path, *common, "mesh.data=4", "actor.ppo_micro_batch_size=4", "critic.ppo_micro_batch_size=4")

    on_two, on_four = memory.memory_plan(two, check_mesh(two, 2)), memory.memory_plan(four, check_mesh(four, 4))

    for term in ("kv_cache", "activations/actor", "activations/critic", "logits/actor"):
        assert on_four.term(term) * 2 == on_two.term(term), term
    assert on_four.term("parameters/actor") == on_two.term("parameters/actor")  # data replicates the parameters


def test_continuous_batching_slots_are_split_over_the_decoding_shards(tmp_path):
    # rollout.max_num_seqs counts the slots of the whole sampler, as it splits them: 16 slots on 2 devices are 8
    # rows decoded at once on each, on 4 devices 4 (so the response cache halves with the prompt cache)
    common = ["actor.ppo_mini_batch_size=128", "critic.ppo_mini_batch_size=128", "rollout.max_num_seqs=16",
              "actor.ppo_micro_batch_size=4", "critic.ppo_micro_batch_size=4"]
    two, four = (quickstart(tmp_path, *common, f"mesh.data={d}") for d in (2, 4))
    on_two, on_four = memory.memory_plan(two, check_mesh(two, 2)), memory.memory_plan(four, check_mesh(four, 4))
    assert on_four.term("kv_cache") * 2 == on_two.term("kv_cache")


def test_remat_keeps_less_than_all_layers(tmp_path):
    kept, recomputed = (memory.memory_plan(quickstart(tmp_path, f"model.remat={r}", "mesh.data=1"), (1, 1, 1))
                        for r in (False, True))
    assert recomputed.term("activations/actor") < kept.term("activations/actor")


def test_the_command_prints_a_table_and_refuses_a_bad_config(tmp_path, capsys):
    output = f"trainer.output_dir={tmp_path / 'run'}"
    assert plan.main(["--config", str(QUICKSTART), "--devices", "8", output]) == 0
    assert "peak" in capsys.readouterr().out
    assert plan.main(["--config", str(QUICKSTART), "--devices", "8", output, "actor.ppo_micro_batch_size=0"]) == 2
    assert "actor.ppo_micro_batch_size" in capsys.readouterr().err
    assert plan.main(["--config", str(QUICKSTART), "--devices", "3", output, "mesh.data=2"]) == 2
    assert "mesh" in capsys.readouterr().err


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_applying_the_gradient_takes_the_planned_float32_copies_of_the_parameters(num_micro_batches):
    """XLA's own accounting of a compiled update, on a model whose parameters dwarf its activations (vocabulary
    16k, 8 tokens a row): the temporaries are the plan's ``STEP_COPIES`` float32 copies of the parameters (plus the
    activations, under 3% here) with an accumulator (K = 2) and without one (K = 1). optax's where-based
    ``apply_if_finite`` and ``MultiSteps.update`` took 6 copies with one micro-batch and 7 with two; applying the
    optimizer inside the micro-batch loop, on its K-th turn, took 4 with two."""
    from bench.actor_update import BatchShape, synthetic_batch
    from jppo.engine import ActorConfig, actor_loss_fn, make_update_step
    from jppo.engine.layout import place
    from jppo.engine.microbatch import make_micro_batches
    from jppo.models import CausalLM, ModelConfig, create_model

    shape = BatchShape(2, 4, 4)
    model_cfg = ModelConfig(vocab_size=16384, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
                            num_kv_heads=2, model_type="qwen2")
    rows = shape.rows // num_micro_batches
    cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=rows, loss_scale_factor=4.0)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, params = nnx.split(create_model(CausalLM, model_cfg, mesh), nnx.Param)
    parameter_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    state = init_train_state(params, cfg, mesh)
    micro = make_micro_batches(synthetic_batch(shape, model_cfg.vocab_size, ragged=False), 1, micro_batch_size=rows)
    step = jax.jit(make_update_step(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor"), donate_argnums=0)
    with jax.set_mesh(mesh):
        temporaries = (
            step.lower(state, place(micro.device_arrays(), mesh)).compile().memory_analysis().temp_size_in_bytes
        )
    assert (state.opt_state.acc_grads is None) == (num_micro_batches == 1)
    copies = memory.STEP_COPIES
    assert copies * parameter_bytes <= temporaries <= 1.03 * copies * parameter_bytes


def test_a_peak_over_what_jax_s_allocator_takes_warns_in_one_line(tmp_path, capsys, monkeypatch):
    """JAX's allocator takes 0.75 of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: a
    device just large enough at 0.75 passes, one just too small warns (one line, exit 0), and a smaller fraction
    makes the larger one warn too. Without --device-memory the CPU reports no limit: no warning."""
    args = ["--config", str(QUICKSTART), "--devices", "1", f"trainer.output_dir={tmp_path / 'run'}", "mesh.data=1"]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert plan.main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    peak, enough = printed["peak_bytes"], printed["peak_bytes"] / 0.75 / 2**30
    assert printed["allocator_bytes"] is None and not capsys.readouterr().err

    def warning(device_gib: float) -> str:
        assert plan.main([*args, "--device-memory", str(device_gib)]) == 0
        return capsys.readouterr().err

    assert warning(enough * 1.01) == ""
    line = warning(enough * 0.99)
    assert line.count("\n") == 1 and "exceeds" in line and footprint.human(peak) in line
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in warning(enough * 1.01)
    assert plan.main([*args, "--device-memory", "0"]) == 2
    assert "--device-memory" in capsys.readouterr().err


@pytest.mark.parametrize("config, overrides, programs", [
    (QUICKSTART, (), {"actor_update", "critic_update", "old_log_prob", "values", "rollout", "validation"}),
    (QUICKSTART.parent / "quickstart_grpo.yaml", ("trainer.val_every=0", "actor.use_kl_loss=true"),
     {"actor_update", "old_log_prob", "ref_log_prob", "rollout"}),
], ids=["ppo", "grpo-kl"])
def test_each_program_has_a_planned_peak_that_holds_its_parameters(tmp_path, config, overrides, programs):
    cfg = load_config(config, [f"trainer.output_dir={tmp_path / 'run'}", "mesh.data=1", *overrides])
    planned, per_program = memory.memory_plan(cfg, (1, 1, 1)), memory.program_bytes(cfg, (1, 1, 1))
    assert set(per_program) == programs
    assert per_program["actor_update"] > planned.term("parameters/actor") + planned.term("optimizer_state/actor")
    sampling = max(per_program["rollout"], per_program.get("validation", 0))
    assert sampling >= planned.term("parameters/actor") + planned.term("kv_cache") > planned.term("parameters/actor")
    assert max(per_program.values()) <= planned.peak_bytes + planned.term("parameters/actor")


GRPO = QUICKSTART.parent / "quickstart_grpo.yaml"


@pytest.fixture(scope="module")
def grpo_programs(tmp_path_factory):
    """The quickstart GRPO run's update and rollout compiled for this machine's first CPU device (the off-policy
    steps change neither program, only what else the run holds beside them)."""
    from jppo.preflight import compiled
    from jppo.preflight.targets import Target

    cfg = load_config(GRPO, [f"trainer.output_dir={tmp_path_factory.mktemp('run')}", "trainer.val_every=0",
                             "mesh.data=1"], data_files=False)
    target = Target("cpu", "cpu", (jax.devices()[0],), 1, None)
    return {p.name: p for p in compiled.compile_run(cfg, target, only=("actor_update", "rollout"))}


def queue_bytes(params, k: int) -> tuple[int, int]:
    """``(queue, before)``: the bytes of the distinct buffers ``RunState.behind`` holds once k updates have pushed
    their weights (the run's own initial queue and pushes), and of the copy an update's step makes beforehand."""
    from jppo.run.offpolicy import copied, initial_behind, pushed

    behind = initial_behind(params, k)
    for _ in range(k):
        behind = pushed(behind, copied(params))
    distinct = {id(x): x.nbytes for x in jax.tree.leaves(behind)} if behind else {}
    return sum(distinct.values()), sum(x.nbytes for x in jax.tree.leaves(copied(params)))


@pytest.mark.parametrize("k", [0, 1, 4])
def test_the_plan_counts_the_off_policy_queue_and_the_rollout_beside_the_update(tmp_path, grpo_programs, k):
    """With ``trainer.off_policy_steps`` k >= 1 the run holds k copies of the trained parameters, one more while
    it updates, and on one device samples the next batch beside the update: the plan's peak is within 10% of XLA's
    bytes of the compiled update, plus (k >= 1) the compiled rollout beside it (less the weights it reads, a copy of
    the queue) and the copies; at k = 0 the larger of the two programs."""
    cfg = load_config(GRPO, [f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_every=0", "mesh.data=1",
                             f"trainer.off_policy_steps={k}"])
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = nnx.state(build.build_policy(cfg, build.load_inputs(cfg).tokenizer, mesh), nnx.Param)
    queue, before = queue_bytes(params, k)
    update, rollout = grpo_programs["actor_update"], grpo_programs["rollout"]

    planned = memory.memory_plan(cfg, (1, 1, 1, 1))

    assert planned.term("off_policy_queue") == queue == k * before
    assert planned.term("weights_before_update") == (before if k else 0)
    if k == 0:
        compiled = max(update.peak_bytes, rollout.peak_bytes)
    else:
        compiled = update.peak_bytes + rollout.xla_bytes - before + queue + before
    assert 0.9 * compiled <= planned.peak_bytes <= 1.1 * compiled, (planned.peak_bytes, compiled)


def test_the_command_reports_the_off_policy_copies_in_its_peak(tmp_path, capsys):
    """On 8 devices (the rollout in turn with the update) k = 4 off-policy steps add the queue's 4 copies of the
    trained parameters and the one an update makes beforehand, nothing else; on one device also the rollout's
    phase, sampled beside the update."""
    def peak(devices: int, k: int) -> dict:
        assert plan.main(["--config", str(GRPO), "--devices", str(devices), "--json", f"trainer.output_dir={tmp_path}",
                          f"mesh.data={devices}", f"trainer.off_policy_steps={k}", "trainer.val_every=0",
                          "trainer.val_before_train=false"]) == 0  # no validation phase: the steps' own peak
        return json.loads(capsys.readouterr().out)

    on_policy, behind = peak(8, 0), peak(8, 4)
    copy = behind["terms"]["parameters/actor"]
    assert behind["terms"]["off_policy_queue"] == 4 * copy
    assert behind["peak_bytes"] - on_policy["peak_bytes"] == 5 * copy
    one, one_behind = peak(1, 0), peak(1, 4)
    phases = one_behind["phase_bytes"]
    assert phases["rollout"] == sum(one_behind["terms"][name]
                                    for name in ("kv_cache", "sampler_logits", "prefill", "rollout_weights"))
    update = max(phases["actor backward"], phases["actor head"], phases["actor optimizer step"])
    assert one_behind["persistent_bytes"] - one["persistent_bytes"] == 4 * copy and phases["each step"] == copy
    assert one["peak_bytes"] == one["persistent_bytes"] + max(phases["rollout"], update)
    assert one_behind["peak_bytes"] == one_behind["persistent_bytes"] + copy + phases["rollout"] + update


def test_a_rollout_mesh_has_a_plan_of_its_own(tmp_path, capsys):
    """rollout.devices=2 of 4, bfloat16 sampling: the training mesh keeps the colocated run's persistent terms and
    update phases, no sampler, and a weight move phase (its shards cast to bfloat16, the norms' scales not copied);
    each rollout device holds a whole replica (bfloat16, the (2 L + 1) D norm scales in float32) and the sampler's
    caches for half the rows, as a colocated 2-device mesh's sampler does."""
    from jppo.preflight.split_memory import split_plans

    cfg = quickstart(tmp_path, "mesh.data=2", "rollout.devices=2", "rollout.dtype=bfloat16")
    training, rollout = split_plans(cfg, check_mesh(cfg, 4))
    colocated = memory.memory_plan(cfg, (2, 1, 1, 1))
    n = colocated.term("parameters/actor") // 4  # float32 parameters, whole on every device of a data mesh
    norms = (2 * cfg.model.num_layers + 1) * cfg.model.hidden_size
    assert training.persistent == colocated.persistent and training.rollout == training.validation == ()
    assert training.updates == {**colocated.updates, "weight move": training.updates["weight move"]}
    assert training.term("weight_move") == (n - norms) * 2
    assert rollout.mesh == {"data": 2, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1} and rollout.persistent == ()
    assert rollout.term("rollout_weights") == (n - norms) * 2 + norms * 4
    # the sampler's larger phase (training or validation batch) of the colocated 2-device mesh, the same rows each
    phase = max((colocated.rollout, colocated.validation), key=lambda terms: sum(t.bytes for t in terms))
    sampling = {t.name.split("/")[0]: t.bytes for t in phase if not t.name.startswith("rollout_weights")}
    assert set(sampling) == {"kv_cache", "sampler_logits", "prefill"} and sampling["kv_cache"] > 0
    assert all(rollout.term(name) == value for name, value in sampling.items())
    assert rollout.peak_bytes == rollout.term("rollout_weights") + sum(sampling.values())
    # each sampler program is planned with its own batch's terms (--compile-for's figures), the mesh's peak the larger
    # one's; before, both programs got the peak (10.47 GiB planned for a rollout XLA compiled at 3.43 on 8 x H100)
    from jppo.preflight.split_memory import rollout_program_bytes

    programs = rollout_program_bytes(cfg)
    for name, terms in (("rollout", colocated.rollout), ("validation", colocated.validation)):
        own = sum(t.bytes for t in terms if not t.name.startswith("rollout_weights"))
        assert programs[name] == rollout.term("rollout_weights") + own
    assert max(programs.values()) == rollout.peak_bytes
    output = f"trainer.output_dir={tmp_path / 'run'}"
    assert plan.main(["--config", str(QUICKSTART), "--devices", "4", output, "mesh.data=2", "rollout.devices=2",
                      "rollout.dtype=bfloat16", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rollout_mesh"]["terms"]["rollout_weights"] == rollout.term("rollout_weights")
    assert "kv_cache" not in printed["terms"] and printed["peak_bytes"] == training.peak_bytes


SFT = QUICKSTART.parent / "quickstart_sft.yaml"


@pytest.mark.parametrize("micro_batch", [4, 32], ids=["K8", "K1"])
def test_the_plan_of_an_sft_config_is_the_compiled_sft_update_s_bytes(tmp_path, micro_batch):
    """An SFT config plans ``python -m jppo.sft``'s update (the policy, its optimizer, one micro-batch's gradients,
    activations and logits; no critic, rollout or reference): within 10% of XLA's bytes of the compiled SFT update
    (arguments + outputs - donated + temporaries) on the quickstart SFT's first step, with an accumulator (8
    micro-batches) and without (one). ``sft.max_length`` is the data's longest row, so the planned micro-batch is
    the compiled one."""
    from jppo.engine import UpdateStep, sft_loss_fn
    from jppo.engine.assemble import assemble, device_rows
    from jppo.engine.driver import global_lengths, stacked_step_cut
    from jppo.engine.objectives import loss_inputs
    from jppo.preflight.sft_memory import sft_plan, sft_program_bytes
    from jppo.run import sft as sft_run
    from jppo.run.learn import mini_batch_rng

    cfg = load_config(SFT, [f"trainer.output_dir={tmp_path / 'run'}", "mesh.data=1", "sft.max_length=13",
                            f"actor.ppo_micro_batch_size={micro_batch}"])
    inputs = sft_run.load_inputs(cfg)
    assert sum(inputs.train.widths) == 13  # the longest row: BOS, 5 digits, "=", 5 digits, EOS
    planned = sft_plan(cfg, (1, 1, 1, 1))
    assert set(planned.updates) == {"sft backward", "sft head", "sft optimizer step"} and not planned.rollout
    assert planned.validation and planned.term("parameters/policy") > 0  # the held-out greedy score's sampling
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    view = sft_run.sft_view(cfg)
    actor = build.models(sft_run.sft_config(cfg), inputs.tokenizer, mesh, roles=("actor",), reference=False).actor
    state = init_train_state(actor.params, view, mesh, frozen=actor.frozen)
    assert planned.term("parameters/policy") == device_bytes(state.params)
    assert planned.term("optimizer_state/policy") == device_bytes(state.opt_state, per_parameter_only=True)
    batch = inputs.train.experience(inputs.train.rows_at(0, cfg.sft.batch_size, cfg.trainer.seed))
    cut = stacked_step_cut(global_lengths(batch, mesh), view, mesh, mini_batch_rng(cfg.trainer.seed, 1, "sft"))
    micro = assemble(device_rows(batch, loss_inputs(view), mesh), cut, mesh, None)
    update = UpdateStep(actor.graphdef, sft_loss_fn(view), view, mesh, "sft")
    memory_analysis = update.lower(state, micro).compile().memory_analysis()
    xla = (memory_analysis.argument_size_in_bytes + memory_analysis.output_size_in_bytes
           - memory_analysis.alias_size_in_bytes + memory_analysis.temp_size_in_bytes)
    planned = sft_program_bytes(cfg, (1, 1, 1, 1), platform="cpu")  # compiled here by XLA:CPU
    assert 0.9 * xla <= planned <= 1.1 * xla, (planned, xla)


def test_the_sft_plan_cuts_micro_batches_over_every_row_axis_as_the_run(tmp_path):
    # mesh.expert splits rows as data and fsdp do: 32 rows over 8 expert shards are one micro-batch of 4 rows each,
    # no accumulator (planned once over data x fsdp alone: 8 micro-batches and an accumulator the run does not have)
    from jppo.engine.config import fixed_micro_batch_count
    from jppo.parallel.mesh import batch_shards
    from jppo.preflight.sft_memory import sft_accumulates
    from jppo.run import sft as sft_run

    cfg = load_config(SFT, [f"trainer.output_dir={tmp_path}", "sft.batch_size=32", "actor.ppo_micro_batch_size=4",
                            "mesh.data=1", "mesh.expert=8"])
    shape = sft_run.mesh_shape(cfg, 8)
    assert fixed_micro_batch_count(sft_run.sft_view(cfg), batch_shards(make_mesh(*shape))) == 1  # the run's
    assert not sft_accumulates(cfg, dict(zip(MESH_AXES, shape)))


def test_the_command_plans_an_sft_config_as_the_sft_run(tmp_path, capsys):
    """``python -m jppo.plan --config configs/quickstart_sft.yaml``: the SFT update's terms and the held-out
    greedy score's sampling, none of an RL run's (critic, rollout); ``--compile-for`` refuses it in one line."""
    from jppo.preflight.sft_memory import sft_plan

    argv = ["--config", str(SFT), f"trainer.output_dir={tmp_path / 'run'}"]
    assert plan.main([*argv, "--devices", "4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = sft_plan(load_config(SFT, argv[2:]), (4, 1, 1, 1, 1))
    assert printed["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}
    assert printed["peak_bytes"] == expected.peak_bytes and set(printed["terms"]) == {
        "parameters/policy", "optimizer_state/policy", "gradients/policy", "weights_in_use/policy",
        "layer_gradient/policy", "activations/policy", "kept_activations/policy", "head_weights/policy",
        "logits/policy", "optimizer_step/policy", "kv_cache/validation",
        "sampler_logits/validation", "prefill/validation", "rollout_weights/validation"}
    assert plan.main([*argv, "--compile-for", "v5p:2x2x2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "jppo.plan: error: --compile-for compiles the programs of an RL run; this config sets the sft section "
        "(python -m jppo.sft's): plan it without --compile-for")


def test_the_command_plans_a_real_size_config_from_the_model_s_shape_alone(tmp_path, capsys):
    """``python -m jppo.plan`` reads shapes, never prompts: the GSM8K config plans with its placeholder data paths
    (no such files here) and a folder holding only Qwen2.5-0.5B's ``config.json``. At least the parameters in
    float32 and AdamW's two moments, 494M x 12 bytes over the 8 devices' fsdp 8 (about 0.7 GiB), are per device."""
    from bench.numbers.plan_table import write_checkpoints

    model = write_checkpoints(tmp_path)["Qwen2.5-0.5B"]
    argv = ["--config", str(QUICKSTART.parent / "qwen2_5_0_5b_gsm8k_grpo.yaml"), f"model.path={model}"]
    assert plan.main([*argv, "--devices", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1, "expert": 1}
    assert printed["peak_bytes"] > 494_000_000 * 12 // 8


def test_a_gpu_forward_pass_counts_the_layout_copy_of_the_largest_layer_stack_not_a_cast_copy():
    # XLA:GPU's buffer assignment of a log-prob pass (7B, fsdp 8) holds f32[448, 28, 18944]: one MLP stack, split
    # over fsdp, in the stored float32, and no bfloat16 copy of all the weights (docs/compiling.md); and, for a tied
    # embedding, the table's shard in the LM head's layout (f32[112, 151936] at 0.5B on fsdp 8). The quickstart's
    # largest stack is an MLP one, [2 layers, 64, 128] (or its transpose), split over fsdp 2; its tied table is
    # [vocabulary, 64], split over fsdp 2 along the 64.
    cfg = load_config(GRPO, ["actor.use_kl_loss=true"])
    mesh = {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 1, "expert": 1}
    model = footprint.model_config(cfg)
    assert model.tie_word_embeddings and model.hidden_size == 64
    stack = 2 * 64 * 128 // 2 + model.vocab_size * 64 // 2
    assert layout_copies.layout_copy_bytes(model, mesh, "float32") == stack * 4
    assert layout_copies.layout_copy_bytes(model, mesh, "bfloat16") == stack * 2
    untied = dataclasses.replace(model, tie_word_embeddings=False)
    assert layout_copies.layout_copy_bytes(untied, mesh, "float32") == 2 * 64 * 128 // 2 * 4
    gpu, tpu = (memory.program_bytes(cfg, (1, 2, 1, 1, 1), platform) for platform in ("gpu", "tpu"))
    forward = lambda platform: memory.forward_bytes(  # noqa: E731
        cfg, footprint.model_config(cfg), "actor", views.forward_micro_batching(cfg, "actor"), mesh, platform)
    params = memory.memory_plan(cfg, (1, 2, 1, 1, 1), "gpu").term("parameters/actor")
    assert gpu["old_log_prob"] == params + stack * 4 + forward("gpu")
    assert tpu["old_log_prob"] == params + forward("tpu")  # the quickstart computes in float32: no cast copy


def test_on_a_gpu_every_stack_of_the_experts_is_laid_out_anew_and_their_rows_expanded_over_the_experts():
    # XLA:GPU's buffer assignment of Qwen3-30B-A3B (h200x8, fsdp 2 x expert 4): its old log-probs' pass holds each
    # of the three expert stacks in another layout, f32[1024, 48, 32, 768], and a round's 32768 (token, expert) pairs
    # expanded over the device's 32 experts, bf16[32768, 32, 2048]; the update the stacks too (docs/algorithms.md).
    # quickstart_moe's one layer with experts: 8 experts of [64, 32] three times and its router [64, 8], split over
    # expert 4 (the experts) and fsdp 2 (the 64), float32; rounds of 16 tokens, k = 2, on the 4 devices' group.
    cfg = load_config("configs/quickstart_moe.yaml", ["model.expert_chunk_size=16"])
    mesh = {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 1, "expert": 4}
    model = footprint.model_config(cfg)
    assert (model.num_experts, model.num_experts_per_tok, len(model.sparse_layers)) == (8, 2, 1)
    experts = 3 * (8 // 4) * (64 // 2) * 32 + (64 // 2) * 8
    assert layout_copies.expert_layout_bytes(model, mesh, "float32") == experts * 4
    dense = load_config(GRPO, [])
    assert layout_copies.expert_layout_bytes(footprint.model_config(dense), mesh, "float32") == 0
    pairs, width = 4 * 16 * 2, 64  # the round's pairs of the group; max(D 64, F_e 32)
    for backward, copies in ((False, 1), (True, 3)):
        assert footprint.expanded_rows_bytes(model, mesh, 100, backward, "gpu") == copies * pairs * 2 * width * 4
        assert footprint.expanded_rows_bytes(model, mesh, 100, backward, "tpu") == 0
    update = memory.memory_plan(cfg, (1, 2, 1, 1, 4), "gpu").updates["actor backward"]
    assert {t.name: t.bytes for t in update}["expert_layout/actor"] == experts * 4
    assert "expert_layout/actor" not in {t.name for t in memory.memory_plan(cfg, (1, 2, 1, 1, 4), "tpu").updates[
        "actor backward"]}


def test_a_tpu_sampler_holds_a_tied_table_in_a_second_layout():
    # XLA:TPU's buffer assignment of Qwen2.5-0.5B's validation (tied embeddings) holds the sampler's bfloat16 table
    # [151936, 896] twice at its peak (the gathered table and a copy in another layout), an untied or GPU one once;
    # the training rollout's peak (its cache written in place) holds it once
    cfg = load_config(GRPO, ["model.tie_word_embeddings=true", "rollout.dtype=bfloat16", "trainer.val_every=1"])
    policy, mesh = footprint.model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}
    rollout, validation = ({t.name: t.bytes for t in phase}
                           for phase in sampler_memory.sampler_terms(cfg, policy, mesh, "tpu"))
    assert validation["table_layout"] == policy.vocab_size * policy.hidden_size * 2 and "table_layout" not in rollout
    untied = load_config(GRPO, ["model.tie_word_embeddings=false"])
    assert not any(t.name == "table_layout" for phase in sampler_memory.sampler_terms(
        cfg, policy, mesh, "gpu") for t in phase)
    assert not any(t.name == "table_layout" for phase in sampler_memory.sampler_terms(
        untied, footprint.model_config(untied), mesh, "tpu") for t in phase)
