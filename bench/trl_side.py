"""TRL's side of :mod:`bench.peers`: a ``GRPOTrainer`` set up to run jppo's training step, and its clock.

:func:`trl_arguments` maps one jppo training step onto TRL's batch settings (see :mod:`bench.peers`);
:func:`trl_setup` builds the trainer's dataset, reward function and ``GRPOConfig`` from a jppo config; :func:`run_trl`
trains with the phases timed by wrappers around TRL's methods, :mod:`bench.trl_alone` with TRL's own class.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from jppo.config import TrainConfig
from jppo.run import build


def trl_arguments(cfg: TrainConfig) -> dict:
    """TRL's batch settings for one jppo training step (``ppo_epochs`` x mini-batches optimizer steps of
    micro-batches after one generation), in sequences. TRL computes old log-probs only when ``num_iterations > 1``
    or ``steps_per_generation > gradient_accumulation_steps``: where jppo's ``actor.old_log_prob: auto`` does."""
    n = cfg.rollout.n
    batch, mini = cfg.data.train_batch_size * n, cfg.actor.ppo_mini_batch_size * n
    micro = cfg.actor.ppo_micro_batch_size
    if batch % mini or mini % micro:
        raise ValueError(f"batch {batch}, mini-batch {mini}, micro-batch {micro} sequences: each must divide the last")
    return {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": mini // micro,
        "steps_per_generation": batch // micro,
        "num_iterations": cfg.actor.ppo_epochs,
        "num_generations": n,
        "max_completion_length": cfg.rollout.max_response_length,
        "optimizer_steps_per_generation": cfg.actor.ppo_epochs * batch // mini,
    }


def per_step_seconds(boundaries: Sequence[float]) -> list[float]:
    """Seconds of each training step from the clock at the start and at the end of every step."""
    return [after - before for before, after in zip(boundaries, boundaries[1:])]


@dataclasses.dataclass
class TrlSetup:
    """What a ``GRPOTrainer`` needs for ``steps`` jppo training steps, and what it records while training:
    ``lengths`` (every completion's token count), ``marks`` (the clock at the start of training and at the end of
    each training step's last optimizer step) and ``threads`` (torch's intra-op threads along the way)."""

    args: Any
    dataset: Any
    reward: Callable
    model_path: str
    optimizer_steps: int  # optimizer steps per training step
    lengths: list[int] = dataclasses.field(default_factory=list)
    marks: list[float] = dataclasses.field(default_factory=list)
    threads: dict = dataclasses.field(default_factory=lambda: {"set": torch.get_num_threads()})

    def step_clock(self):
        """A ``TrainerCallback`` noting :attr:`marks` and :attr:`threads`."""
        import transformers

        setup = self

        class StepClock(transformers.TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                setup.threads["train_begin"] = torch.get_num_threads()
                setup.marks.append(time.perf_counter())

            def on_train_end(self, args, state, control, **kwargs):
                setup.threads["train_end"] = torch.get_num_threads()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % setup.optimizer_steps == 0:
                    setup.marks.append(time.perf_counter())

        return StepClock()

    def mean_response_length(self) -> float | None:
        return float(np.mean(self.lengths)) if self.lengths else None


def trl_setup(cfg: TrainConfig, steps: int, out: pathlib.Path) -> TrlSetup:
    """The dataset (the task's training prompts and answers), the reward (jppo's own reward function on the decoded
    completions) and the ``GRPOConfig`` of ``steps`` training steps matching ``cfg`` (see :mod:`bench.peers`)."""
    import datasets
    from trl import GRPOConfig

    inputs = build.load_inputs(cfg)
    batch = trl_arguments(cfg)
    per_step = batch.pop("optimizer_steps_per_generation")
    examples = build.task_of(cfg.data).examples("train", cfg.data.train_batch_size * steps, cfg.trainer.seed)
    answers = {example.prompt: example for example in examples}
    dataset = datasets.Dataset.from_dict(
        {"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})
    eos = set(inputs.tokenizer.eos_ids)
    lengths: list[int] = []

    def reward(prompts, completions, completion_ids, **_):
        finished = [len(ids) > 0 and ids[-1] in eos for ids in completion_ids]
        lengths.extend(len(ids) for ids in completion_ids)
        rows = [answers[prompt] for prompt in prompts]
        return [float(x) for x in inputs.reward_fn(list(completions), rows, finished)]

    optim = cfg.actor.optim
    args = GRPOConfig(
        output_dir=str(out / "trl"), use_vllm=False, report_to=[], bf16=False, fp16=False, use_cpu=True,
        **batch, temperature=cfg.rollout.temperature, top_k=0, top_p=1.0, beta=0.0, epsilon=cfg.actor.clip_ratio,
        loss_type="dapo", scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        learning_rate=optim.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=optim.weight_decay,
        max_grad_norm=optim.grad_clip, max_steps=steps * per_step, logging_steps=10**6, save_strategy="no",
        disable_tqdm=True, seed=cfg.trainer.seed, log_completions=False, dataloader_num_workers=0,
        mask_truncated_completions=False, gradient_checkpointing=False,  # TRL's default recomputes; jppo's does not
    )
    return TrlSetup(args, dataset, reward, cfg.model.path, per_step, lengths)


def train(setup: TrlSetup, trainer_class) -> None:
    """Loads the exported model as ``Qwen2ForCausalLM`` and trains it with ``trainer_class`` (TRL's
    ``GRPOTrainer`` or a subclass)."""
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(setup.model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup.model_path)
    trainer = trainer_class(
        model=model, reward_funcs=setup.reward, args=setup.args, train_dataset=setup.dataset,
        processing_class=tokenizer, callbacks=[setup.step_clock()],
    )
    trainer.train()


def run_trl(cfg: TrainConfig, steps: int, out: pathlib.Path) -> dict:
    """``steps`` training steps of TRL's ``GRPOTrainer`` matching ``cfg``; per-step seconds and phases."""
    from trl import GRPOTrainer

    phases: list[dict[str, float]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Notes the seconds of the step's parts: ``generate`` (``_generate_single_turn``: tokenization and
        ``generate``), ``old_log_prob`` (``_get_per_token_logps_and_entropies`` without gradients), then below
        ``score_and_rest`` (the rest of ``_generate_and_score_completions``: decoding, reward, advantages) and
        ``update`` (the rest of the step: the optimizer steps with their forward and backward passes)."""

        def _generate_and_score_completions(self, *args, **kwargs):
            phases.append({"generate": 0.0, "old_log_prob": 0.0})
            start = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            phases[-1]["generate_and_score"] = time.perf_counter() - start
            return result

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate_single_turn(*args, **kwargs)
            phases[-1]["generate"] += time.perf_counter() - start
            return result

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if not torch.is_grad_enabled() and phases:
                phases[-1]["old_log_prob"] += time.perf_counter() - start
            return result

    setup = trl_setup(cfg, steps, out)
    train(setup, TimedGRPOTrainer)
    seconds = per_step_seconds(setup.marks)
    for record, total in zip(phases, seconds):
        record["score_and_rest"] = record["generate_and_score"] - record["generate"] - record["old_log_prob"]
        record["update"] = total - record.pop("generate_and_score")
        record["step"] = total
    return {"steps": phases[: len(seconds)], "mean_response_length": setup.mean_response_length(),
            "torch_threads": setup.threads}
