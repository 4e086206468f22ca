"""Prompts for the trainer: tokenizers, built-in tasks with their scorers, and resumable prompt datasets."""

from jppo.core.inputs import DataConfig
from jppo.data.code_task import WriteProgram  # (registers the task)
from jppo.data.datasets import PromptDataset, load_dataset, read_examples, task_of
from jppo.data.tasks import BUILTIN_TASKS, Example, ReasoningGymTask, Task, get_task
from jppo.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BUILTIN_TASKS",
    "CharTokenizer",
    "DataConfig",
    "Example",
    "HFTokenizer",
    "PromptDataset",
    "ReasoningGymTask",
    "Task",
    "Tokenizer",
    "WriteProgram",
    "get_task",
    "load_dataset",
    "load_tokenizer",
    "read_examples",
    "task_of",
]
