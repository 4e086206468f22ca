"""``python -m jppo.plan --compile-for``: the run's programs compiled by the TPU compiler for a 2-host v5p slice
(8 compile-only chips, libtpu's), on this CPU machine.

A quickstart-sized run (a 2-layer, 64-wide decoder) on three meshes: rows over ``data`` with the reference
attention (through the command, its JSON), rows over ``data`` x ``fsdp`` with Pallas attention (splash, the TPU's
kernel), and ``fsdp`` x ``sequence`` (context parallelism) with blockwise attention. Every program compiles; the
decoding loop runs no collective per token on every mesh, its stop test included (each device decodes its own rows
and stops when they have ended). With ``rollout.devices`` on a one-host v5p the sampler compiles on the last chips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.expert_flops import EXPERTS
from jppo import plan
from jppo.config import check_mesh, load_config
from jppo.preflight import compiled, targets
from jppo.preflight.memory import program_bytes

TARGET = "v5p:2x2x2"
TINY = ["trainer.val_every=0", "actor.ppo_epochs=1", "critic.ppo_epochs=1"]


@pytest.fixture(scope="module")
def v5p():
    return targets.target(TARGET)


def test_the_command_compiles_every_program_of_the_run(capsys):
    """GRPO's quickstart (reference attention, rows over ``data``) through the command."""
    code = plan.main(["--config", "configs/quickstart_grpo.yaml", "--compile-for", TARGET, "--json",
                      "model.attention=reference", *TINY])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (report["target"], report["devices"], report["hosts"]) == (TARGET, 8, 2)
    assert report["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}
    names = [p["name"] for p in report["programs"]]
    assert names == ["actor_update", "old_log_prob", "rollout"]
    for program in report["programs"]:
        assert set(program) >= {"name", "compiled", "error", "xla_bytes", "plan_bytes", "collectives",
                                "decode_step_collectives", "flops"}
        assert program["compiled"] and program["error"] is None, program
        assert program["xla_bytes"] > 0 and program["plan_bytes"] > 0 and program["flops"] > 0
        assert all(isinstance(n, int) and n > 0 for n in program["collectives"].values())
    rollout = report["programs"][-1]
    assert rollout["decode_step_collectives"] == {}  # nothing per layer, nor for the stop test (each device's own)
    assert all(p["decode_step_collectives"] is None for p in report["programs"][:-1])


# The quickstart's size in the TPU's tiles (128 lanes): heads of 128 (hidden 256, MLP 1024) and rows of 256 tokens.
# The 64-wide quickstart is padded to them, and its arrays are so small that XLA's own overheads outweigh the
# plan's terms: the plan is a fifth of XLA's count there.
TILED = ["model.hidden_size=256", "model.num_heads=2", "model.intermediate_size=1024", "data.max_prompt_length=128",
         "rollout.prompt_bucket=128", "rollout.max_response_length=128"]


@pytest.mark.parametrize("mesh, attention, plan_within", [
    (["mesh.data=2", "mesh.fsdp=4"], "pallas", None),
    (["mesh.data=1", "mesh.fsdp=2", "mesh.sequence=4", *TILED], "blockwise", 0.10),
])
def test_update_and_rollout_compile_for_a_two_host_slice(v5p, mesh, attention, plan_within):
    cfg = load_config("configs/quickstart_grpo.yaml", [*mesh, f"model.attention={attention}", *TINY],
                      data_files=False)
    programs = {p.name: p for p in compiled.compile_run(cfg, v5p, only=("actor_update", "rollout"))}
    assert set(programs) == {"actor_update", "rollout"}
    for program in programs.values():
        assert program.compiled, (program.name, program.error)
        assert 0 < program.xla_bytes <= program.peak_bytes
    if plan_within is not None:  # python -m jppo.plan's figure for each program, against XLA's bytes
        planned = program_bytes(cfg, check_mesh(cfg, len(v5p.devices), v5p.hosts), v5p.platform)
        for name, program in programs.items():
            assert abs(planned[name] / program.xla_bytes - 1) <= plan_within, (name, planned[name], program.xla_bytes)
    # decoding splits rows over every batch axis, sequence included: a sequence device decodes rows of its own,
    # and runs the loop on them: a decoded token communicates nothing on the context-parallel mesh too. Before,
    # the loop ran on the global rows and its stop test was one all-reduce per token.
    assert programs["rollout"].decode_step_collectives == {}


# quickstart_moe widened (the experts outweigh the rest): every layer with experts, d 256, F_e 512; rows of 256
# tokens (the TPU's tiles) with splash attention, whose scores take no memory: what is left to plan is the experts'.
# (EXPERTS, from bench.expert_flops, which reads the same rows' experts' flops)


@pytest.mark.parametrize("mesh", [
    ["mesh.data=8", "model.num_experts_per_tok=2"],
    ["mesh.data=8", "model.num_experts_per_tok=8"],
    ["mesh.data=1", "mesh.expert=8", "model.num_experts_per_tok=8"],  # the exchange: e n k pairs on each device
])
def test_the_plan_of_a_model_with_experts_is_within_a_tenth_of_its_hbm(v5p, mesh):
    """Every program's plan within 10% of the HBM XLA's buffer assignment gives it, k = 2 and 8 experts a token
    over ``data``, and k = 8 over ``expert`` (the group's tokens gathered: the update's 2.38 GiB in HBM, where it is
    0.32 GiB at k = 2 over ``data``).
    ``memory_analysis()``'s figure on a TPU counts more than that (:func:`jppo.preflight.compiled.device_memory_bytes`).
    Before a forward pass's pairs were planned as the backward pass keeps them (rows sorted and unsorted, three
    intermediates), the old log-probs were planned at 1.38 and 1.54 of these bytes at k = 8 and the rollouts at
    1.13 and 1.40; the update on ``data`` at k = 2 at 0.905, without a layer's weight gradient."""
    cfg = load_config("configs/quickstart_moe.yaml", [*EXPERTS, *mesh], data_files=False)
    programs = compiled.compile_run(cfg, v5p)
    planned = program_bytes(cfg, check_mesh(cfg, len(v5p.devices), v5p.hosts), v5p.platform)
    assert [p.name for p in programs] == ["actor_update", "old_log_prob", "rollout"]
    for program in programs:
        assert program.compiled, (program.name, program.error)
        assert 0 < program.hbm_bytes < program.xla_bytes
        assert abs(planned[program.name] / program.hbm_bytes - 1) <= 0.10, (
            program.name, planned[program.name], program.hbm_bytes)


@pytest.mark.parametrize("name, message", [
    ("v9:2x2", "--compile-for 'v9:2x2': not a TPU topology libtpu compiles for"),
    ("h100", "--compile-for 'h100': not a target"),
    # libtpu's v4 has two devices per chip, a mesh jax.make_mesh refuses (it once died in a traceback, exit 1)
    ("v4:2x2x1", "--compile-for 'v4:2x2x1': libtpu describes this slice with 8 devices, two per chip (TPU v4)"),
    ("b200x8", "--compile-for 'b200x8': no description of the GPU 'b200'"),
])
def test_a_bad_target_is_one_line_and_exit_2(capsys, name, message):
    code = plan.main(["--config", "configs/quickstart.yaml", "--compile-for", name])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"jppo.plan: error: {message}") and err.count("\n") == 1


def test_flops_are_xlas_own_count_with_loops_multiplied_out(v5p):
    """Matrix-product flops read off the compiled text equal XLA's ``cost_analysis()`` on programs without loops
    (a product, a batched one and its gradient, as the TPU compiler rewrites them into convolutions; XLA also
    counts the few elementwise flops of the squares, < 1%), and a ``lax.scan`` of 5 products counts 5 of them
    where XLA counts its body once."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    from jppo.preflight import hlo  # noqa: PLC0415

    mesh = Mesh(np.array(v5p.devices).reshape(2, 4), ("a", "b"))
    arg = lambda *shape, spec=PartitionSpec(): jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    batched = lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k)  # noqa: E731
    squares = lambda q, k: jnp.sum(batched(q, k).astype(jnp.float32) ** 2)  # noqa: E731

    def compiled(fn, *args):
        executable = jax.jit(fn).lower(*args).compile()
        return hlo.flops(hlo.parse(executable.as_text())), executable.cost_analysis()["flops"]

    for fn, args in [
        (jnp.matmul, (arg(256, 512, spec=PartitionSpec("a")), arg(512, 1024, spec=PartitionSpec(None, "b")))),
        (batched, (arg(4, 8, 128, 64), arg(4, 8, 256, 64))),
        (jax.grad(squares, argnums=(0, 1)), (arg(4, 8, 128, 64), arg(4, 8, 256, 64))),
    ]:
        ours, xla = compiled(fn, *args)
        assert ours <= xla <= 1.01 * ours

    def scanned(w, x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    ours, xla = compiled(scanned, arg(512, 512), arg(256, 512))
    assert ours == 5 * xla == 5 * 2 * 256 * 512 * 512


def test_the_tpu_grouped_product_counts_every_row_of_its_buffer(v5p):
    """``jax.lax.ragged_dot`` compiles to a Mosaic kernel on a TPU, a custom call XLA's ``cost_analysis()`` does not
    count: the reader counts ``2 M K N`` for its ``[M, K]`` rows by ``[G, K, N]`` groups, as for one product of
    the whole buffer (the kernel runs the tiles its groups fill: an upper bound)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    from jppo.preflight import hlo  # noqa: PLC0415

    mesh = Mesh(np.array(v5p.devices), ("a",))
    arg = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    executable = jax.jit(jax.lax.ragged_dot).lower(arg(512, 256), arg(4, 256, 384), arg(4, dtype=jnp.int32)).compile()
    module = hlo.parse(executable.as_text())
    assert any("ragged_dot_tiling=" in i.attributes for c in module.computations.values() for i in c)
    assert hlo.flops(module) == 2 * 512 * 256 * 384


def test_the_rollout_compiles_on_the_rollout_devices_of_a_split_host():
    """rollout.devices=2 of a one-host v5p:2x2x1 (4 chips), bfloat16 sampling: the sampler's program takes its
    weights (cast to bfloat16, norms' scales float32), prompts and key on the last two chips, the update on the
    first two; nothing else is kept on the rollout devices, so the rollout's peak is its program's bytes."""
    from jppo.parallel.mesh import make_mesh

    target = targets.target("v5p:2x2x1")
    cfg = load_config("configs/quickstart_grpo.yaml", ["mesh.data=2", "rollout.devices=2", "rollout.dtype=bfloat16",
                                                       *TINY], data_files=False)
    training, rollout = make_mesh(2, devices=target.devices[:2]), make_mesh(2, devices=target.devices[2:])
    lower, _, _ = compiled.lowerings(cfg, training, rollout)
    with compiled.without_persistent_cache():
        sampler, update = lower["rollout"]().compile(), lower["actor_update"]().compile()
    devices = lambda executable: {d.id for s in jax.tree.leaves(executable.input_shardings) for d in s.device_set}  # noqa: E731
    assert devices(sampler) == {d.id for d in target.devices[2:]}
    assert devices(update) == {d.id for d in target.devices[:2]}
    args = jax.tree.leaves(lower["rollout"]().args_info)
    assert {
        str(arg.dtype) for arg in args if len(arg.shape) != 2 or "int" not in str(arg.dtype) and arg.dtype != bool
    } >= {"bfloat16", "float32"}  # the weights cast, the norms' scales kept
    _, resident_in, resident = compiled.lowerings(cfg, training, rollout)
    assert resident_in["rollout"] == resident  # its peak: the program's own bytes, the run keeps nothing else there


def test_a_split_of_a_two_host_slice_gives_every_host_devices_of_both_meshes(v5p):
    """rollout.devices=4 of the 2-host v5p:2x2x2: each host's last two chips sample its own rows, its first two
    train (a weight crosses no host: jppo.parallel.hostlocal.replicated_on)."""
    from jppo.config import check_mesh
    from jppo.parallel.mesh import split_devices

    cfg = load_config("configs/quickstart_grpo.yaml", ["rollout.devices=4", *TINY], data_files=False)
    assert check_mesh(cfg, len(v5p.devices), v5p.hosts) == (4, 1, 1, 1, 1)
    training, rollout = split_devices(v5p.devices, 4)
    assert sorted(d.process_index for d in training) == sorted(d.process_index for d in rollout) == [0, 0, 1, 1]
    for host in (0, 1):
        own = [d for d in v5p.devices if d.process_index == host]
        assert [d for d in rollout if d.process_index == host] == own[2:]
