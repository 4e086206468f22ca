"""Convert GSM8K (``question``/``answer`` rows, the answer ending in ``#### <number>``) into jppo's prompt JSONL.

Usage::

    python -m jppo.data.prepare_gsm8k SRC.parquet|SRC.jsonl OUT.jsonl

Each output line is ``{"prompt": <question> + INSTRUCTION, "answer": <the original answer>}``: the worked solution
is kept whole, and ``reward.kind: gsm8k`` compares the number after its last ``####`` with the response's. Get the
source from the GSM8K release (``main`` configuration, ``train`` and ``test`` splits) on a machine with network
access; this script itself downloads nothing. Then train with::

    data: {task: files, train_files: gsm8k_train.jsonl, val_files: gsm8k_test.jsonl, apply_chat_template: true}
    reward: {kind: gsm8k}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Optional, Sequence

from jppo.core.errors import one_line
from jppo.data.datasets import read_rows

INSTRUCTION = ' Think step by step, then give the final answer on the last line as "#### <number>".'


def convert(source: str, output: str) -> int:
    """Writes the converted rows of ``source`` to ``output`` (its folder made if missing); returns how many were
    written."""
    rows = read_rows(source, "the input SRC")
    lines = []
    for number, row in rows:
        missing = [key for key in ("question", "answer") if not isinstance(row.get(key), str)]
        if missing:
            raise KeyError(
                f"{source} row {number} has no text under {missing}; GSM8K rows have 'question' and 'answer'"
            )
        if "####" not in row["answer"]:
            raise ValueError(
                f"{source} row {number}: answer has no '####' final-answer marker: {row['answer'][-60:]!r}"
            )
        lines.append(json.dumps({"prompt": row["question"].strip() + INSTRUCTION, "answer": row["answer"]}))
    out = pathlib.Path(output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # `data/gsm8k/train.jsonl` on a fresh clone
    except OSError as error:
        raise OSError(f"the output OUT {output!r}: cannot make its folder {str(out.parent)!r}: {error}") from None
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jppo.data.prepare_gsm8k", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="GSM8K split as .parquet or .jsonl")
    parser.add_argument("output", help="jppo prompt/answer .jsonl to write")
    args = parser.parse_args(argv)
    try:
        count = convert(args.source, args.output)
    except (ValueError, KeyError, OSError) as error:  # a missing or malformed source, an unwritable output
        print(f"prepare_gsm8k: error: {one_line(error)}", file=sys.stderr)
        return 2
    print(f"wrote {count} examples to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
