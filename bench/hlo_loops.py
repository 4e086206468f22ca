"""The decoding loop of a compiled rollout, read from its partitioned HLO text (``compiled.as_text()``): the
computations its ``while`` runs each iteration (body and condition, with everything they call), and the collectives
among them. XLA's ``cost_analysis()`` counts a loop body once, so what one decoded token costs is read here, per
iteration, not from the whole program's totals.

The decoding loop is the ``while`` of the entry computation whose body runs matrix products (``dot``, or
``convolution`` as the TPU compiler writes some); the other loops of a rollout are the random-bit generator's.
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r"while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """``({computation name: its instruction lines}, the entry computation's name)`` of an HLO module's text."""
    table, entry, name = {}, "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            name = header.group(2)
            table[name] = []
            entry = name if header.group(1) else entry
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            table[name].append(line)
    return table, entry


def reachable(table: dict[str, list[str]], root: str) -> set[str]:
    """``root`` and every computation it calls, directly or not (fusions, loops, conditionals' branches)."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in table:
            continue
        seen.add(name)
        for line in table[name]:
            todo += _CALLED.findall(line)
            for group in _BRANCHES.findall(line):
                todo += re.findall(r"%([\w.\-]+)", group)
    return seen


def count_collectives(lines: list[str]) -> dict[str, int]:
    """How many of each collective ``lines`` run (an asynchronous pair counted once, by its start)."""
    text = "\n".join(lines)
    return {op: len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", text)) for op in COLLECTIVES}


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """The collectives of one iteration of the decoding loop: its body's and its condition's."""

    body: dict[str, int]
    condition: dict[str, int]


def decode_loop(hlo: str) -> DecodeLoop:
    """The decoding loop of a compiled rollout's HLO text (module docstring); raises if there is none."""
    table, entry = computations(hlo)
    for line in table[entry]:
        found = _WHILE.search(line)
        if found is None:
            continue
        body = reachable(table, found.group(2))
        if any(" dot(" in text or " convolution(" in text for name in body for text in table[name]):
            lines = lambda names: [text for name in sorted(names) for text in table[name]]  # noqa: E731
            return DecodeLoop(count_collectives(lines(body)),
                              count_collectives(lines(reachable(table, found.group(1)))))
    raise ValueError("no while loop with matrix products in the entry computation: not a compiled rollout")
