"""``python -m jppo.export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype D] [--max-shard-size 2GB] [--step N]
[--adapters | --base | --keep-adapters]``: a trained policy as a Hugging Face directory that
``AutoModelForCausalLM``, ``AutoTokenizer`` and ``vllm serve`` read as is (a LoRA run's merged weights, its
adapters, their base, or the base with the adapters beside it, which an RL run keeps training).

What is read and what ``OUT_DIR`` receives: :mod:`jppo.run.export`. Errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jppo import cli
from jppo.config import views
from jppo.core.paths import run_path
from jppo.data import load_tokenizer
from jppo.run.export import (
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_DTYPES,
    ExportError,
    base_policy,
    export_adapters,
    export_kept,
    export_policy,
    find_checkpoint,
    merged_policy,
    parse_size,
    restore_policy,
    run_config,
)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a run directory (newest complete checkpoint) or one checkpoint directory")
    parser.add_argument("out", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, help="weights dtype (default: the source model's)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"largest safetensors file, e.g. 500MB, 1GiB (default: {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--step", type=int, help="the checkpoint step of a run directory (default: the newest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty OUT")
    parser.add_argument("--adapters", action="store_true",
                        help="write only the LoRA adapters, in PEFT's layout (default: weights with adapters merged)")
    parser.add_argument("--base", action="store_true",
                        help="write the base model the LoRA adapters were trained on, without them (a random base "
                             "too): the model to load them onto with peft.PeftModel.from_pretrained(base, ADAPTERS)")
    parser.add_argument("--keep-adapters", action="store_true",
                        help="write the base model and, beside it, the LoRA adapters in PEFT's layout: model.path of "
                             "an RL run with the same actor.lora, which trains the same adapters on (unmerged)")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return cli.parse_args(argv, "export", "Export a run's policy as a Hugging Face model directory.", options)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.adapters + args.base + args.keep_adapters > 1:
            raise ExportError("--adapters, --base and --keep-adapters write different directories: export each to "
                              "its own OUT")
        max_shard_bytes = parse_size(args.max_shard_size)
        checkpoint = find_checkpoint(run_path(args.source), args.step)
        cfg = run_config(checkpoint)
        tokenizer = load_tokenizer(views.tokenizer_spec(cfg))
        model = restore_policy(checkpoint, cfg, tokenizer)
        if args.adapters:
            files = export_adapters(model, cfg, args.out, dtype=args.dtype or "float32", replace=args.overwrite)
        elif args.keep_adapters:
            files = export_kept(model, cfg, tokenizer, args.out, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
                                replace=args.overwrite)
        else:
            policy = base_policy(model) if args.base else merged_policy(model)
            files = export_policy(policy, cfg, tokenizer, args.out, dtype=args.dtype,
                                  max_shard_bytes=max_shard_bytes, replace=args.overwrite)
    except (*cli.INPUT_ERRORS, OSError) as error:  # OSError: a directory that cannot be read or written
        return cli.fail("export", error)
    print(f"jppo.export: wrote {args.out} ({len(files)} files) from {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
