"""Checkpoints of a run: one orbax directory per step, committed atomically, restorable onto any mesh.

Layout of a checkpoint directory ``DIRECTORY/<step>/``:

- ``state/``: the arrays (any pytree: ``TrainState`` s, ``nnx.State``, optax states, raw PRNG key data), written by
  every process for the shards it holds (orbax ``StandardSave``);
- ``meta/``: one JSON object (the step, what its models were built from, the config, ...);
- ``commit_success.txt`` and ``_CHECKPOINT_METADATA``: orbax's bookkeeping.

Atomicity: orbax 0.12.8 writes everything into ``DIRECTORY/<step>.orbax-checkpoint-tmp`` and, once all items are
on disk, renames it to ``DIRECTORY/<step>`` (``AtomicRenameTemporaryPath``). A process killed mid-save leaves only
the ``-tmp`` directory, which orbax never lists as a step; the next ``CheckpointManager`` on the directory deletes
it. A bucket (``gs://``) has no rename: there orbax writes into ``DIRECTORY/<step>`` itself and commits by writing
``commit_success.txt`` last (``CommitFileTemporaryPath``); a step without that file is not complete, and is never
listed or resumed either.

Synchronous saves (``async_save=False``): when :meth:`CheckpointManager.save` returns, the checkpoint is committed.
Asynchronous saves (``async_save=True``, ``trainer.async_checkpoint``): ``save`` returns once the arrays are copied
off the devices (to host memory: the next update may overwrite the device buffers), while a background thread
writes them and then commits, after the last byte is written, as above. The next ``save``, :meth:`wait` and
:meth:`close` wait for it; a process killed before the commit leaves the previous complete checkpoint the newest.

Restoring reads each array into the shardings of the *target*, so a checkpoint saved on one mesh restores onto
another mesh or onto a single device; only shapes and the tree structure must match.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils.epath import Path

from jppo.core.checks import register_config_check
from jppo.core.errors import ConfigError, one_line
from jppo.core.paths import run_path

PyTree = Any

STATE_ITEM = "state"
META_ITEM = "meta"
SFT_META = "sft"  # true in the meta of a checkpoint python -m jppo.sft wrote (absent: an RL run's)
RESUME_CHOICES = ("auto", "never")


class CheckpointManager:
    """Saves and restores ``(state, meta)`` checkpoints under ``directory``, keeping the newest ``max_to_keep``.

    In a multi-process run every process calls :meth:`save` and :meth:`restore` (each writes and reads its own
    shards); orbax lets only the primary process write ``meta`` and rename the directory.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = False):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} is invalid: keep at least 1 checkpoint")
        self.async_save = async_save
        self._manager = ocp.CheckpointManager(
            run_path(directory),  # a local folder or a cloud URI (every host must see the same one)
            item_names=(STATE_ITEM, META_ITEM),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,  # written in the background, committed once written
                # Partial saves of an interrupted run are never listed as steps; deleting them only frees the disk.
                cleanup_tmp_directories=True,
            ),
        )

    @property
    def directory(self) -> Path:
        return run_path(self._manager.directory)

    def save(self, step: int, state: PyTree, meta: dict) -> Path:
        """Writes checkpoint ``step`` and returns its directory once committed (with ``async_save``: once its arrays
        are copied off the devices, the write and the commit following in the background); prunes beyond
        ``max_to_keep``.

        ``step`` must come after every step already in the directory: a resumed run that rewound to an older
        checkpoint would otherwise mix two histories, and pruning could delete the step just written.
        """
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as error:
            raise ValueError(f"checkpoint meta of step {step} is not JSON-serializable: {error}") from None
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} is not after the latest step {latest} in {self.directory}; "
                "resume from the latest checkpoint or write to a new directory"
            )
        self._manager.save(
            step,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}),
            force=True,  # the trainer decides when to save; orbax's own save-interval policy stays out of it
        )
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, step: int | str | os.PathLike, target: PyTree) -> tuple[PyTree, dict]:
        """``(state, meta)`` of a checkpoint: ``step`` of this directory, or the path of any checkpoint directory.

        ``target`` gives the structure, shapes, dtypes and shardings to restore into: a pytree of
        ``jax.ShapeDtypeStruct`` with ``.sharding`` (e.g. ``jax.eval_shape`` of the initializer plus the new run's
        shardings), or of concrete arrays laid out as wanted.
        """
        restored = self._read(step, _restore_args(target))
        return restored[STATE_ITEM], restored[META_ITEM]

    def restore_meta(self, step: int | str | os.PathLike) -> dict:
        """Only the JSON ``meta`` of a checkpoint (no arrays are read)."""
        return self._read(step, ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]

    def _read(self, step: int | str | os.PathLike, args: ocp.args.Composite) -> ocp.args.Composite:
        if not isinstance(step, (str, os.PathLike)):
            if step not in self._manager.all_steps():
                raise KeyError(f"no checkpoint step {step} in {self.directory}; committed steps: {self.all_steps()}")
            return self._manager.restore(int(step), args=args)
        return _read_path(step, args)

    def wait(self) -> None:
        """Returns once the save in flight (with ``async_save``), if any, is written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases the manager."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def restore_checkpoint(path: str | os.PathLike, target: PyTree) -> tuple[PyTree, dict]:
    """``(state, meta)`` of the checkpoint directory ``path``, read without a manager (nothing in its directory is
    touched: a run may be writing there), into ``target`` as :meth:`CheckpointManager.restore` does."""
    restored = _read_path(path, _restore_args(target))
    return restored[STATE_ITEM], restored[META_ITEM]


def read_meta(path: str | os.PathLike) -> dict:
    """Only the JSON ``meta`` of the checkpoint directory ``path`` (no array is read), without a manager."""
    return _read_path(path, ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]


def saved_tree(path: str | os.PathLike) -> PyTree:
    """The structure of the state of the complete checkpoint directory ``path`` as nested dicts and lists (a
    dataclass or named tuple as a dict of its fields), an array's metadata at each leaf and None where the saved
    tree held None; no array is read."""
    path = _complete_checkpoint(run_path(path), "checkpoint")
    return ocp.PyTreeCheckpointHandler().metadata(path / STATE_ITEM).tree


def _restore_args(target: PyTree) -> ocp.args.Composite:
    abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract), META_ITEM: ocp.args.JsonRestore()})


def _read_path(path: str | os.PathLike, args: ocp.args.Composite) -> ocp.args.Composite:
    path = _complete_checkpoint(run_path(path), "checkpoint")  # a local folder or a gs:// URI
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        return checkpointer.restore(path, args=args)
    finally:
        checkpointer.close()


def resolve_resume(resume: str, directory: str | os.PathLike) -> int | Path | None:
    """What ``trainer.resume`` points at: a step of ``directory``, a checkpoint path, or ``None`` (start fresh).

    - ``auto``: the newest committed step in ``directory``, or ``None`` when it holds none (or does not exist);
    - ``never``: ``None``;
    - any other value: the path of a checkpoint directory, which must exist and be complete, or of a run's output
      directory (one holding ``checkpoints/``), meaning its newest committed checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return max(committed_steps(directory), default=None)
    if not resume:
        raise ValueError(f"trainer.resume is empty; valid: {', '.join(RESUME_CHOICES)} or a checkpoint directory")
    path = run_path(resume)
    if (path / "checkpoints").is_dir() and not (path / STATE_ITEM).is_dir():  # a run's output directory
        steps = committed_steps(path / "checkpoints")
        if not steps:
            raise ValueError(f"trainer.resume={resume!r}: the run directory holds no complete checkpoint")
        path = path / "checkpoints" / str(steps[-1])
    return _complete_checkpoint(path, "trainer.resume")


@register_config_check("trainer.resume")
def check_resume(cfg) -> None:
    """``trainer.resume``: ``auto``, ``never`` or a checkpoint that is there (:func:`resolve_resume`), checked when
    the config is loaded, before anything is built."""
    try:
        resolve_resume(cfg.trainer.resume, run_path(cfg.trainer.output_dir) / "checkpoints")
    except ValueError as error:
        raise ConfigError(one_line(error)) from None


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The committed steps of a run's checkpoint directory (a local folder or a gs:// URI), oldest first, read
    without a manager (so nothing there is cleaned up: a run may still be writing)."""
    directory = run_path(directory)
    return sorted(ocp.path.step.checkpoint_steps(directory)) if directory.is_dir() else []


def restore_part(path: str | os.PathLike, target: PyTree) -> PyTree:
    """Only the arrays of ``target`` from the state of the complete checkpoint directory ``path``: ``target`` is
    a sub-tree of the saved state as nested dicts (e.g. ``{"actor": {"params": ...}}``) whose leaves are
    ``jax.ShapeDtypeStruct`` with shardings. Nothing else (optimizer moments, the critic) is read."""
    path = _complete_checkpoint(run_path(path), "checkpoint")
    abstract = jax.tree_util.tree_map_with_path(_abstract_leaf, target)
    args = ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True
    )
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        return checkpointer.restore(path / STATE_ITEM, args=args)
    finally:
        checkpointer.close()


def _complete_checkpoint(path: Path, name: str) -> Path:
    """``path`` itself when it is a committed checkpoint with both items, else a one-line error naming ``name``."""
    if not path.is_dir():
        raise ValueError(f"{name}={str(path)!r}: no such checkpoint directory")
    items_present = all((path / item).is_dir() for item in (STATE_ITEM, META_ITEM))
    if not (ocp.path.step.is_path_finalized(path) and items_present):
        raise ValueError(
            f"{name}={str(path)!r} is not a complete checkpoint (an interrupted save, or not written by jppo): "
            f"expected a committed directory with {STATE_ITEM}/ and {META_ITEM}/"
        )
    return path


def _abstract_leaf(path: tuple, leaf: Any) -> jax.ShapeDtypeStruct:
    """The leaf as orbax reads into it; a leaf without a sharding is an error, not the saved run's layout."""
    if isinstance(leaf, jax.Array):  # a concrete array stands for its own shape, dtype and sharding
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
        raise ValueError(
            f"restore target leaf target{jax.tree_util.keystr(path)} = {leaf!r} has no sharding: give every leaf "
            "as a jax.ShapeDtypeStruct with the sharding the new run wants (or as an array laid out that way)"
        )
    return leaf


def fingerprint(tree: PyTree) -> str:
    """16 hex digits that change with any bit of any array of ``tree`` (what a checkpoint leaves out, such as
    LoRA's frozen base, is compared through it): two sums over every element's bits times a weight drawn from its
    position, ``sum_i bits_i * (c * (i + offset) + 1) mod 2^32`` with two odd constants ``c``. Integer sums wrap
    exactly and in any order, so the value does not depend on the arrays' sharding, the mesh or the backend."""
    leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(tree)]
    return "".join(f"{int(lane):08x}" for lane in _fingerprint(leaves))


@jax.jit
def _fingerprint(leaves: list[jax.Array]) -> jax.Array:
    lanes, offset = jnp.zeros(2, jnp.uint32), 0
    for leaf in leaves:
        width = jnp.dtype(leaf.dtype).itemsize * 8
        bits = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{width}")).ravel().astype(jnp.uint32)
        position = jnp.arange(bits.size, dtype=jnp.uint32) + jnp.uint32(offset % 2**32)
        for lane, constant in enumerate((0x9E3779B1, 0x85EBCA77)):
            weight = position * jnp.uint32(constant) + jnp.uint32(1)
            lanes = lanes.at[lane].add(jnp.sum(bits * weight, dtype=jnp.uint32))
        offset += bits.size
    return lanes
