"""``rollout.devices``: the run's devices cut into a training mesh and a rollout mesh, the refusals of a split that
cannot run, and the weight move (:mod:`jppo.run.rollout_mesh`). Whole runs with a rollout mesh, compared with the
colocated run, are in ``test_whole_run.py``."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jppo.config import ConfigError, check_mesh, load_config
from jppo.parallel.mesh import make_mesh, split_devices
from jppo.preflight.split_memory import check_rollout_fits
from jppo.run.rollout_mesh import WeightMove, run_meshes, tree_bytes

GRPO = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"


def test_the_rollout_takes_the_last_devices_and_the_training_mesh_the_others():
    devices = jax.devices()[:4]
    assert split_devices(devices, 0) == (devices, [])
    assert split_devices(devices, 1) == (devices[:3], devices[3:])
    cfg = load_config(GRPO, ["mesh.data=2", "rollout.devices=2"])
    shape = check_mesh(cfg, 4)
    assert shape == (2, 1, 1, 1, 1)
    training, rollout = run_meshes(devices, shape, 2)
    assert list(training.devices.flat) == devices[:2] and list(rollout.devices.flat) == devices[2:]
    assert dict(rollout.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1}


@pytest.mark.parametrize("overrides,devices,processes,message", [
    (["rollout.devices=4"], 4, 1, "rollout.devices=4 must be less than the run's 4 devices"),
    (["rollout.devices=1", "mesh.data=2"], 4, 1,
     "mesh.data=2 x mesh.fsdp=1 x mesh.tensor=1 x mesh.sequence=1 x mesh.expert=1 = 2 devices, but 3 are available "
     "(the 4 devices less rollout.devices=1)"),
    (["rollout.devices=3", "mesh.data=-1"], 4, 2, "rollout.devices=3 must split evenly over the run's 2 processes: "
     "each gives N / 2 of its 2 devices to the rollout"),
])
def test_a_split_that_cannot_run_is_refused_in_one_line(overrides, devices, processes, message):
    cfg = load_config(GRPO, overrides)
    with pytest.raises(ConfigError) as error:
        check_mesh(cfg, devices, processes)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_with_several_processes_each_gives_its_last_devices_to_the_rollout():
    """A process samples its own rows on its own rollout devices, the weights copied from its own training devices
    (tests/test_distributed.py runs it on two processes)."""
    hosts = [Host(id=10 * p + d, process_index=p) for p in range(2) for d in range(4)]
    training, rollout = split_devices(hosts, 4)
    assert [h.id for h in training] == [0, 1, 10, 11] and [h.id for h in rollout] == [2, 3, 12, 13]
    assert check_mesh(load_config(GRPO, ["rollout.devices=4", "mesh.data=-1"]), 8, 2) == (4, 1, 1, 1, 1)


@dataclasses.dataclass(frozen=True)
class Host:
    """A device as :func:`split_devices` reads it: which process holds it."""

    id: int
    process_index: int


def test_a_rollout_device_that_cannot_hold_the_weights_and_caches_is_refused_in_one_line():
    """What a rollout device must hold whatever the compiler does: the quickstart's weights whole in float32 (83,520
    parameters x 4 bytes = 334,080 bytes) and the caches of its rows. A device of JAX's reported size below that is
    refused; one above it, or of unknown size (a CPU's), is not."""
    cfg = load_config(GRPO, ["rollout.devices=1"])
    check_rollout_fits(cfg, None)
    check_rollout_fits(cfg, 2**30)
    with pytest.raises(ConfigError) as error:
        check_rollout_fits(cfg, 334_080)
    message = str(error.value)
    assert message.startswith("rollout.devices=1: a rollout device holds a whole replica of the weights in float32 "
                              "(326.25 KiB) and the caches of its rows") and "\n" not in message


def test_a_negative_count_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^rollout.devices=-1"):
        load_config(GRPO, ["rollout.devices=-1"])


def test_the_weights_move_replicated_in_the_rollout_dtype_with_the_norm_scales_kept():
    """bfloat16 rollouts: every weight the sampler reads in its compute dtype crosses in it (half the bytes), the
    norm scales (read in float32) as they are; the values are the cast the sampler would make itself."""
    training = make_mesh(1, devices=jax.devices()[:1])
    rollout = make_mesh(2, devices=jax.devices()[1:3])
    weights = {"kernel": jax.device_put(jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6),
                                        jax.sharding.NamedSharding(training, jax.sharding.PartitionSpec())),
               "input_norm": jnp.full((6,), 1.0 + 2.0**-20, jnp.float32)}
    moved, size = WeightMove(rollout, "bfloat16")(weights)
    assert moved["kernel"].dtype == jnp.bfloat16 and moved["input_norm"].dtype == jnp.float32
    assert size == 24 * 2 + 6 * 4 == tree_bytes(moved)
    for array in moved.values():
        assert array.sharding.mesh.devices.tolist() == rollout.devices.tolist() and array.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(moved["kernel"]), np.asarray(weights["kernel"].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(moved["input_norm"]), np.asarray(weights["input_norm"]))
    as_they_are, _ = WeightMove(rollout, None)(weights)  # LoRA: the adapters' product is formed in float32
    assert as_they_are["kernel"].dtype == jnp.float32
