"""Run logger: strict-JSON lines, resume truncation, TensorBoard events, progress output on and off a terminal."""

from __future__ import annotations

import io
import json
import re
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jppo.runlog import METRICS_FILE, RunLogger, read_metrics


def strict_lines(path: Path) -> list[dict]:
    """Every line parsed as standard JSON: NaN/Infinity tokens (Python's extension) are rejected."""

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def read_events(directory: Path) -> list:
    """Every event of the TensorBoard files (TFRecord: u64 length, u32 crc, data, u32 crc), file by file."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for file in sorted(directory.glob("events.out.tfevents.*")):
        data, position = file.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position : position + 8])
            events.append(Event.FromString(data[position + 12 : position + 12 + length]))
            position += 12 + length + 4
    return events


def scalars(events) -> list[tuple[str, int, float]]:
    return sorted((value.tag, event.step, value.simple_value) for event in events for value in event.summary.value)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_are_strict_json_with_null_for_non_finite(tmp_path):
    with RunLogger(tmp_path, total_steps=3, sinks=("jsonl",)) as logger:
        logger.log(1, {"actor/pg_loss": np.float32(0.5), "reward/mean": jnp.asarray(2.0), "count": 3})
        logger.log(2, {"actor/pg_loss": float("nan"), "critic/vf_loss": float("inf"), "x": -float("inf")})
        logger.log(np.int64(3), {})
    assert strict_lines(tmp_path / METRICS_FILE) == [
        {"step": 1, "actor/pg_loss": 0.5, "reward/mean": 2.0, "count": 3.0},
        {"step": 2, "actor/pg_loss": None, "critic/vf_loss": None, "x": None},
        {"step": 3},
    ]


def test_each_line_is_flushed_as_it_is_logged(tmp_path):
    logger = RunLogger(tmp_path, total_steps=5, sinks=("jsonl",))
    logger.log(1, {"a": 1.0})
    assert strict_lines(tmp_path / METRICS_FILE) == [{"step": 1, "a": 1.0}]  # before close
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(2, {"a": 1.0})


def test_resume_drops_the_interrupted_runs_later_steps(tmp_path):
    with RunLogger(tmp_path, total_steps=10, sinks=("jsonl",)) as first_run:
        for step in range(1, 6):
            first_run.log(step, {"a": float(step)})
    with open(tmp_path / METRICS_FILE, "a") as file:
        file.write('{"step": 6, "a": ')  # the crash tore the last line

    # The checkpoint was at step 3: the resumed run redoes steps 4, 5, 6 and each step appears once.
    with RunLogger(tmp_path, total_steps=10, sinks=("jsonl",), start_step=4) as resumed:
        for step in (4, 5, 6):
            resumed.log(step, {"a": 10.0 * step})
    assert strict_lines(tmp_path / METRICS_FILE) == [
        {"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 3.0},
        {"step": 4, "a": 40.0}, {"step": 5, "a": 50.0}, {"step": 6, "a": 60.0},
    ]

    # A fresh run (start_step 0) into the same directory starts the file over.
    RunLogger(tmp_path, total_steps=10, sinks=("jsonl",)).close()
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_read_metrics_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "a": null}\n{"step": 2, "a": 0.5}\n{"step": 3, "a"')
    assert read_metrics(path) == [{"step": 1, "a": None}, {"step": 2, "a": 0.5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a JSON object"):
        read_metrics(path)


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    board = tmp_path / "tensorboard"
    with RunLogger(tmp_path, total_steps=4, sinks=("jsonl", "tensorboard")) as logger:
        logger.log(1, {"actor/pg_loss": 0.25, "reward/mean": 1.5})
        logger.log(2, {"actor/pg_loss": -0.5})
    [event_file] = board.glob("events.out.tfevents.*")
    assert event_file.stat().st_size > 0
    first_run = [("actor/pg_loss", 1, 0.25), ("actor/pg_loss", 2, -0.5), ("reward/mean", 1, 1.5)]
    assert scalars(read_events(board)) == first_run

    # Resumed within the same second: a second file, the first one intact, and a purge marker at the start step
    # so that TensorBoard hides the first run's step 2.
    from tensorboardX.proto.event_pb2 import SessionLog

    with RunLogger(tmp_path, total_steps=4, sinks=("jsonl", "tensorboard"), start_step=2) as resumed:
        resumed.log(2, {"actor/pg_loss": 0.75})
    events = read_events(board)
    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    assert scalars(events) == [
        ("actor/pg_loss", 1, 0.25), ("actor/pg_loss", 2, -0.5), ("actor/pg_loss", 2, 0.75), ("reward/mean", 1, 1.5),
    ]
    # the fresh run hid everything before it (step 0 on), the resumed one hides the first run's steps from 2 on
    assert sorted(event.step for event in events if event.session_log.status == SessionLog.START) == [0, 2]


def test_summary_lines_off_a_terminal(tmp_path):
    stream = io.StringIO()
    with RunLogger(tmp_path, total_steps=25, sinks=("console", "jsonl"), summary_every=10, stream=stream) as logger:
        for step in range(1, 26):
            metrics = {"reward/mean": 0.5, "actor/pg_loss": -0.0123, "critic/vf_loss": 2.0, "actor/ppo_kl": 4e-4}
            logger.log(step, metrics if step != 20 else {"other": 1.0})
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"step (\d+)/25 \| ", line).group(1)) for line in lines] == [1, 10, 20, 25]
    number = r"[-+0-9.e]+"
    assert re.fullmatch(
        rf"step 10/25 \| {number} s/step \| eta \d+m\d\ds \| reward 0\.5  pg_loss -0\.0123  vf_loss 2  ppo_kl 0\.0004",
        lines[1],
    ), lines[1]
    assert re.fullmatch(rf"step 20/25 \| {number} s/step \| eta \d+m\d\ds", lines[2]), lines[2]
    assert "\r" not in stream.getvalue()


def test_progress_bar_on_a_terminal(tmp_path):
    terminal = Terminal()
    with RunLogger(tmp_path, total_steps=10, sinks=("console", "jsonl"), stream=terminal, start_step=4) as logger:
        for step in (4, 5):
            logger.log(step, {"reward/mean": 0.75, "actor/ppo_kl": 0.001})
    output = terminal.getvalue()
    assert "5/10" in output and "reward 0.75" in output and "ppo_kl 0.001" in output
    assert "step 5/10 |" not in output  # the bar replaces the summary lines


def test_disabled_outputs_and_non_main_process(tmp_path):
    stream = io.StringIO()
    with RunLogger(tmp_path, total_steps=2, sinks=("jsonl",), stream=stream) as logger:
        logger.log(2, {"reward/mean": 1.0})
    assert stream.getvalue() == "" and not (tmp_path / "tensorboard").exists()

    elsewhere = tmp_path / "not_main"
    with RunLogger(elsewhere, total_steps=2, is_main_process=False, stream=stream) as follower:
        follower.log(1, {"reward/mean": 1.0})
        follower.log(1, {"anything": "goes"})  # no checks either: nothing is written
    follower.log(2, {})
    assert not elsewhere.exists() and stream.getvalue() == ""


def test_bad_input_is_a_one_line_error(tmp_path):
    with RunLogger(tmp_path, total_steps=5, sinks=("jsonl",), start_step=2) as logger:
        with pytest.raises(ValueError, match=r"step=1 is invalid: expected an integer >= start_step 2"):
            logger.log(1, {})
        with pytest.raises(ValueError, match=r"step='3' is invalid"):
            logger.log("3", {})
        logger.log(3, {})
        with pytest.raises(ValueError, match="step 3 after step 3: steps must increase"):
            logger.log(3, {})
        with pytest.raises(ValueError, match="metric 'actor/pg_loss' is not a scalar number"):
            logger.log(4, {"actor/pg_loss": np.ones(2)})
        with pytest.raises(ValueError, match="metric name 'step'"):
            logger.log(4, {"step": 1.0})
    with pytest.raises(ValueError, match="total_steps=0 is invalid"):
        RunLogger(tmp_path, total_steps=0)
    with pytest.raises(ValueError, match="summary_every=0 is invalid"):
        RunLogger(tmp_path, total_steps=3, summary_every=0)


def test_step_zero_holds_what_is_measured_before_training(tmp_path):
    """A fresh run logs validation before training at step 0 (verl's global step 0); a resumed run keeps it."""
    stream = io.StringIO()
    with RunLogger(tmp_path, total_steps=3, sinks=("console", "jsonl"), stream=stream) as logger:
        logger.log(0, {"val/reward/mean": 0.25})
        logger.log(1, {"reward/mean": 0.5})
    assert stream.getvalue().splitlines()[0] == "step 0/3 | before training"
    assert re.match(r"step 1/3 \| [-+0-9.e]+ s/step \| eta ", stream.getvalue().splitlines()[1])
    with RunLogger(tmp_path, total_steps=3, sinks=("jsonl",), start_step=2) as resumed:
        resumed.log(2, {"reward/mean": 0.75})
    assert [record["step"] for record in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 2]
