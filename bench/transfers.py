"""Host <-> device bytes of one training step, by phase, call site and field, at a GSM8K-like shape.

    python -m bench.transfers [--quick] [--devices 8] [--scale 4]

Runs the trainer's own stages in this process (:func:`jppo.run.loop.setup`, then :func:`jppo.run.collect.collect` and
:func:`jppo.run.learn.learn` for a warm-up step and one measured step) with a counting shim installed by this module
only; jppo's code is not changed. The shim wraps the functions through which data crosses:

- host -> device: ``jax.make_array_from_process_local_data`` (every :func:`jppo.parallel.hostlocal.to_global`, so the
  sampler's prompts, the micro-batches :func:`jppo.engine.layout.place` puts on the mesh, the advantage and
  KL-in-reward inputs) and ``jax.device_put`` of host values (numpy arrays, Python and numpy scalars); the bytes
  counted are those that land on the devices (the sum over the result's addressable shards);
- device -> host: ``jax.Array``'s host value (``np.asarray``, ``jax.device_get``, ``float()``, ... all read it),
  counted at each read that copies (a fully replicated array is read from one device).

Each crossing is filed under the trainer's phase running at the time (the phases of ``timing/<phase>``: rollout,
reward, old_log_prob, ref_log_prob, values, advantages, update_critic, update_actor; ``other`` outside them), the
jppo function that caused it, and a field: the pytree path inside ``place`` when :mod:`jppo.engine.assemble`
places rows or a plan (``advantages``, ``prompt_ids``, ``row_ids``, ...), else the array's dtype and shape. What the shim does not see: a numpy array handed straight
to a jitted function (none in a training step at the time of writing) and device-to-device copies (not host
crossings).

The unit is the step's :class:`~jppo.core.experience.Experience` as :func:`~jppo.run.collect.collect` returns it (every
field, rows x length), so ``bytes moved / experience bytes`` says how many times the step moves its own data.

Shape: the GSM8K GRPO config (``configs/qwen2_5_0_5b_gsm8k_grpo.yaml``: 128 prompts x 5 responses, prompts up to
512 and responses 512 tokens, mini-batches of 32 prompts, token-budget micro-batches of 4096 tokens, KL loss so a
reference pass) with a tiny random model on the character vocabulary, and prompt length, response length and
token budget divided by ``--scale`` (default 4: dense attention over 1024-token rows does not fit a CPU minute).
The per-token bytes scale with the lengths, so the ratios hold at scale 1. Responses have no EOS, so every one runs
to its maximum length (the most tokens a step can carry). Both ``ppo_epochs`` = 1 and 2 are measured.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import pathlib
import sys
from typing import Iterator

SIZES = {
    # prompts, responses per prompt, mini-batch (prompts), real lengths (divided by the scale), model
    "full": dict(prompts=128, n=5, mini=32, prompt=512, response=512, max_token_len=4096, scale=4,
                 hidden=64, layers=2),
    "quick": dict(prompts=8, n=5, mini=8, prompt=512, response=512, max_token_len=4096, scale=32,
                  hidden=64, layers=2),
}
PHASES = ("rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantages", "update_critic",
          "update_actor", "other")
JPPO = pathlib.Path(__file__).resolve().parents[1] / "jppo"
# modules whose functions only relay a crossing; the site reported is the jppo function that called them
RELAYS = ("hostlocal.py", "layout.py", "assemble.py")


@dataclasses.dataclass
class Counter:
    """Bytes and number of crossings keyed by ``(direction, phase, site, field)``; ``direction`` is ``h2d`` or
    ``d2h``. ``phase`` and ``field`` are set by the shim's wrappers while they run."""

    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    count: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    phase: str = "other"
    field: str | None = None
    depth: int = 0  # > 0 inside a counted host -> device call (its own inner device_put is not counted again)
    on: bool = False

    def add(self, direction: str, nbytes: int, described: str) -> None:
        if not self.on or nbytes == 0:
            return
        key = (direction, self.phase, caller_site(), self.field or described)
        self.bytes[key] += int(nbytes)
        self.count[key] += 1

    def total(self, direction: str, phase: str | None = None) -> int:
        return sum(b for (d, p, _, _), b in self.bytes.items() if d == direction and phase in (None, p))

    def by(self, direction: str, phase: str, position: int) -> dict[str, int]:
        """Bytes of one direction and phase, summed by site (``position`` 2) or field (3)."""
        out: collections.Counter = collections.Counter()
        for key, b in self.bytes.items():
            if key[0] == direction and key[1] == phase:
                out[key[position]] += b
        return dict(out)

    def rows(self) -> list[dict]:
        return [
            dict(direction=d, phase=p, site=s, field=f, bytes=b, crossings=self.count[(d, p, s, f)])
            for (d, p, s, f), b in sorted(self.bytes.items(), key=lambda item: (item[0][0], item[0][1], -item[1]))
        ]


def caller_site() -> str:
    """``module.py:function`` of the innermost jppo frame that is not a relay (``?`` outside jppo)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename)
        if JPPO in path.parents and path.name not in RELAYS:
            return f"{path.relative_to(JPPO.parent)}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


def _described(value) -> str:
    import numpy as np

    array = np.asarray(value) if not hasattr(value, "dtype") else value
    return f"{array.dtype}[{','.join(map(str, array.shape))}]"


def _landed_bytes(result) -> int:
    """Bytes the devices received: every addressable shard of every array of ``result``."""
    import jax

    return sum(shard.data.nbytes for leaf in jax.tree.leaves(result) for shard in leaf.addressable_shards)


@contextlib.contextmanager
def counting(counter: Counter) -> Iterator[Counter]:
    """Installs the shim (see the module docstring) for the duration of the block."""
    import jax
    from jax._src.array import ArrayImpl

    from jppo.engine import assemble, layout

    make_array, device_put, place = jax.make_array_from_process_local_data, jax.device_put, layout.place
    value = ArrayImpl._value

    def counted_make_array(sharding, local_data, global_shape=None):
        counter.depth += 1
        try:
            out = make_array(sharding, local_data, global_shape)
        finally:
            counter.depth -= 1
        if counter.depth == 0:
            counter.add("h2d", _landed_bytes(out), _described(local_data))
        return out

    def counted_device_put(x, *args, **kwargs):
        counter.depth += 1
        try:
            out = device_put(x, *args, **kwargs)
        finally:
            counter.depth -= 1
        if counter.depth == 0:
            for leaf, placed in zip(jax.tree.leaves(x), jax.tree.leaves(out)):
                if not isinstance(leaf, jax.Array):  # a host value; device-to-device copies are not counted
                    counter.add("h2d", _landed_bytes(placed), _described(leaf))
        return out

    def labelled_place(arrays, mesh, scanned=1):
        def one(path, array):
            counter.field = jax.tree_util.keystr(path, simple=True, separator=".")
            try:
                return place(array, mesh, scanned)
            finally:
                counter.field = None

        return jax.tree_util.tree_map_with_path(one, arrays)

    def host_value(self):
        if self._npy_value is None and counter.depth == 0:
            replicated = self.is_fully_replicated and self.sharding.has_addressable_devices
            nbytes = self.addressable_shards[0].data.nbytes if replicated else self.nbytes
            counter.add("d2h", nbytes, _described(self))
        return value.fget(self)

    patches = [
        (jax, "make_array_from_process_local_data", counted_make_array), (jax, "device_put", counted_device_put),
        (assemble, "place", labelled_place), (ArrayImpl, "_value", property(host_value)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield counter
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def phase_timer(counter: Counter):
    """The trainer's :class:`~jppo.runlog.timing.PhaseTimer` that also tells ``counter`` which phase runs."""
    from jppo.runlog.timing import PhaseTimer

    class CountingTimer(PhaseTimer):
        @contextlib.contextmanager
        def __call__(self, phase: str):
            counter.phase = phase
            try:
                with super().__call__(phase):
                    yield
            finally:
                counter.phase = "other"

    return CountingTimer()


def overrides(size: dict, epochs: int) -> list[str]:
    """The GSM8K GRPO config's algorithm and batch settings at ``size``'s scale, on the reverse_digits task (its
    prompts, of 1/2 to 1 x the prompt length, stand in for GSM8K's)."""
    prompt, response = size["prompt"] // size["scale"], size["response"] // size["scale"]
    return [
        "data.task=reverse_digits", f"data.task_options={{min_len: {prompt // 2}, max_len: {prompt - 2}}}",
        f"data.train_batch_size={size['prompts']}", f"data.max_prompt_length={prompt}",
        f"model.hidden_size={size['hidden']}", f"model.intermediate_size={2 * size['hidden']}",
        f"model.num_layers={size['layers']}", "model.num_heads=4", f"model.max_position_embeddings={prompt + response}",
        f"actor.ppo_mini_batch_size={size['mini']}", "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len={size['max_token_len'] // size['scale']}", f"actor.ppo_epochs={epochs}",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.001", "actor.kl_loss_type=low_var_kl",
        "actor.log_prob_chunk_size=64", f"rollout.n={size['n']}", f"rollout.max_response_length={response}",
        f"rollout.prompt_bucket={max(prompt // 8, 1)}", "algorithm.adv_estimator=grpo",
        "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1", "trainer.val_every=0", "trainer.val_before_train=false",
    ]


def experience_bytes(exp) -> dict[str, int]:
    """Bytes of every field of the step's Experience (this process's rows)."""
    return {f.name: int(getattr(exp, f.name).nbytes) for f in dataclasses.fields(exp)
            if getattr(exp, f.name) is not None}


def measure_step(size: dict, epochs: int) -> dict:
    """One warm-up step, then one counted step, of the trainer at ``size`` with ``ppo_epochs=epochs``."""
    from unittest import mock

    import jax

    from jppo.config import views
    from jppo.run import build
    from jppo.run import loop
    from jppo.run.collect import collect
    from jppo.config import check_mesh, load_config
    from jppo.run.learn import learn
    from jppo.parallel.mesh import make_mesh

    cfg = load_config(None, overrides(size, epochs))
    mesh = make_mesh(*check_mesh(cfg, jax.device_count()))
    inputs = build.load_inputs(cfg)
    sampling = views.sampling_params

    def no_eos(*args, **kwargs):  # every response runs to its maximum length
        return dataclasses.replace(sampling(*args, **kwargs), eos_token_ids=())

    counter = Counter()
    with mock.patch.object(views, "sampling_params", no_eos), counting(counter):
        state, collector, learner, _ = loop.setup(cfg, mesh, inputs)
        for counted in (False, True):
            counter.on = counted
            timer = phase_timer(counter)
            state, exp, _ = collect(collector, state, timer)
            state, _ = learn(learner, state, exp, timer)
            jax.block_until_ready(state.actor.params)
            counter.on = False
    fields = experience_bytes(exp)
    total = sum(fields.values())
    h2d, d2h = counter.total("h2d"), counter.total("d2h")
    return {
        "epochs": epochs,
        "rows": exp.num_sequences, "prompt_length": exp.prompt_ids.shape[1], "response_length": exp.response_ids.shape[1],
        "experience_bytes": total, "experience_fields": fields,
        "h2d_bytes": h2d, "d2h_bytes": d2h,
        "h2d_per_experience": h2d / total, "d2h_per_experience": d2h / total,
        "phases": {
            phase: {"h2d": counter.total("h2d", phase), "d2h": counter.total("d2h", phase),
                    "h2d_fields": counter.by("h2d", phase, 3), "d2h_fields": counter.by("d2h", phase, 3),
                    "sites": sorted(set(counter.by("h2d", phase, 2)) | set(counter.by("d2h", phase, 2)))}
            for phase in PHASES if counter.total("h2d", phase) or counter.total("d2h", phase)
        },
        "crossings": counter.rows(),
    }


def measure(quick: bool, scale: int | None = None, epochs: tuple[int, ...] = (1, 2)) -> dict:
    """Both ``ppo_epochs`` settings at the quick or full size (``scale`` replaces the size's length divisor)."""
    import jax

    size = dict(SIZES["quick" if quick else "full"])
    if scale is not None:
        size["scale"] = scale
    steps = {f"epochs={e}": measure_step(size, e) for e in epochs}
    out = {"mode": "quick" if quick else "full", "size": size, "devices": jax.device_count(), "steps": steps}
    if len(epochs) > 1:
        first, last = steps[f"epochs={epochs[0]}"], steps[f"epochs={epochs[-1]}"]
        out["h2d_per_extra_epoch"] = (last["h2d_bytes"] - first["h2d_bytes"]) / (epochs[-1] - epochs[0])
    first = next(iter(steps.values()))
    out["h2d_per_experience"] = first["h2d_per_experience"]
    out["d2h_per_experience"] = first["d2h_per_experience"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1/32 of the lengths, 8 prompts (a smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--scale", type=int, help="divide the GSM8K lengths by this (default: 4, quick: 32)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.devices < 1 or (args.scale is not None and args.scale < 1):
        print("bench.transfers: error: --devices and --scale must be >= 1", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before any JAX operation
    from bench.report import section

    result = measure(args.quick, args.scale)
    print(section("transfers", result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
