"""Seconds of a compiled XLA:CPU program's operations, from its optimized HLO and a profiler trace of one run.

XLA:CPU runs a program as thunks, one per top-level HLO instruction (a fusion, a ``dot``, a loop, ...), and its
profiler notes each thunk twice: an event named after the instruction when the thunk is started and an
``end: <name>`` event when its result is ready. A thunk may return before its work is done (a library
contraction runs on the thread pool), and independent thunks run at the same time, so a thunk's seconds here are
its *span*, from its start to its ``end:`` event: two products that overlap each count the whole overlap.

:func:`instructions` reads the instructions of ``compiled.as_text()``; :func:`head_part` names the LM head's
product a ``dot`` is (by its contraction and output sizes); :func:`spans` pairs the trace's events;
:func:`head_seconds` adds them up per part of the head.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Optional

HEAD_PARTS = ("forward", "grad_hidden", "grad_weight", "vocab_elementwise")
CONTROL_FLOW = ("while", "conditional", "call")  # thunks that hold other thunks: their spans are not work
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(")
_DIMS = re.compile(r"^[a-z]\w*\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its opcode, output dimensions (``None`` for a tuple), operand names, the computation
    it calls (a fusion's body) and, for a ``dot``, its left operand's contracting dimensions."""

    opcode: str
    dims: Optional[tuple[int, ...]]
    operands: tuple[str, ...]
    calls: Optional[str] = None
    lhs_contracting: tuple[int, ...] = ()


def _split_shape(rest: str) -> tuple[str, str]:
    """``rest`` after ``%name = ``: its shape (a tuple's up to the matching parenthesis) and what follows."""
    if not rest.startswith("("):
        shape, _, after = rest.partition(" ")
        return shape, after
    depth = 0
    for index, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[: index + 1], rest[index + 2:]
    return rest, ""


def _parse(line: str) -> Optional[tuple[str, Instruction]]:
    match = _NAME.match(line)
    if match is None:
        return None
    shape, after = _split_shape(line[match.end():])
    opcode, _, args = after.partition("(")
    dims = _DIMS.match(shape)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args)
    called = re.search(r"calls=%([\w.\-]+)", args)
    return match[1], Instruction(
        opcode=opcode,
        dims=tuple(int(d) for d in dims[1].split(",") if d) if dims else None,
        operands=tuple(re.findall(r"%([\w.\-]+)", args.split(")", 1)[0])),
        calls=called[1] if called else None,
        lhs_contracting=tuple(int(d) for d in contracting[1].split(",") if d) if contracting else (),
    )


def instructions(hlo_text: str) -> tuple[dict[str, Instruction], dict[str, list[str]]]:
    """Every instruction of an HLO module's text by name (names are unique in a module), and the names of each
    computation's instructions."""
    table: dict[str, Instruction] = {}
    members: dict[str, list[str]] = {}
    current = ""
    for line in hlo_text.splitlines():
        computation = _COMPUTATION.match(line)
        if computation is not None:
            current = computation[1]
            members[current] = []
            continue
        parsed = _parse(line)
        if parsed is not None:
            table[parsed[0]] = parsed[1]
            members.setdefault(current, []).append(parsed[0])
    return table, members


def head_part(dot: Instruction, table: dict[str, Instruction], tokens: int, hidden: int, vocab: int) -> Optional[str]:
    """Which product of an LM head ``[tokens, hidden] x [hidden, vocab]`` a ``dot`` is: ``forward`` (contracts
    ``hidden``, outputs ``tokens x vocab``), ``grad_hidden`` (contracts ``vocab``: ``dlogits @ W^T``),
    ``grad_weight`` (outputs ``hidden x vocab``: ``h^T @ dlogits``), or ``None`` (not a head product)."""
    lhs = table.get(dot.operands[0]) if dot.operands else None
    if lhs is None or lhs.dims is None or dot.dims is None:
        return None
    return product_part(math.prod(lhs.dims[i] for i in dot.lhs_contracting), math.prod(dot.dims), tokens, hidden, vocab)


def product_part(contracted: int, out: int, tokens: int, hidden: int, vocab: int) -> Optional[str]:
    """The head product (see :func:`head_part`) a matrix product of ``contracted`` summed elements per output and
    ``out`` outputs is, or ``None``."""
    named = {(vocab, tokens * hidden): "grad_hidden", (hidden, tokens * vocab): "forward",
             (tokens, hidden * vocab): "grad_weight"}
    return named.get((contracted, out))


def classify(name: str, table: dict[str, Instruction], members: dict[str, list[str]], tokens: int, hidden: int,
             vocab: int) -> str:
    """The part of the step a top-level instruction is: one of :data:`HEAD_PARTS` (``vocab_elementwise``: any
    other operation with a ``tokens x vocab`` output: softmax, log-softmax, entropy, their gradients), ``control``
    (a loop or conditional) or ``rest``."""
    inst = table.get(name)
    if inst is None:
        return "rest"
    if inst.opcode in CONTROL_FLOW:
        return "control"
    dots = [table[m] for m in members.get(inst.calls or "", []) if table[m].opcode == "dot"]
    for dot in ([inst] if inst.opcode == "dot" else dots):
        part = head_part(dot, table, tokens, hidden, vocab)
        if part is not None:
            return part
    if inst.dims is not None and math.prod(inst.dims) == tokens * vocab and vocab in inst.dims:
        return "vocab_elementwise"
    return "rest"


@dataclasses.dataclass(frozen=True)
class Span:
    name: str
    start_ns: float
    end_ns: float


def spans(events: Iterable[tuple[str, float, float]]) -> list[Span]:
    """Thunk spans from ``(name, start_ns, duration_ns)`` events: each thunk event paired, in time order, with the
    next ``end: <name>`` event (a thunk without one spans its own event)."""
    starts: dict[str, list[tuple[float, float]]] = {}
    ends: dict[str, list[float]] = {}
    for name, start, duration in sorted(events, key=lambda event: event[1]):
        if name.startswith("end: "):
            ends.setdefault(name[5:], []).append(start)
        else:
            starts.setdefault(name, []).append((start, duration))
    out = []
    for name, opened in starts.items():
        closed = ends.get(name, [])
        for index, (start, duration) in enumerate(opened):
            end = closed[index] if index < len(closed) and closed[index] >= start else start + duration
            out.append(Span(name, start, max(end, start + duration)))
    return out


def overlap_s(first: list[Span], second: list[Span]) -> float:
    """Seconds during which a span of ``first`` and a span of ``second`` both ran."""
    total = 0.0
    for a in first:
        for b in second:
            total += max(0.0, min(a.end_ns, b.end_ns) - max(a.start_ns, b.start_ns))
    return total / 1e9


def covered_s(thunks: list[Span]) -> float:
    """Seconds during which at least one of ``thunks`` ran (the union of their spans)."""
    total, reach = 0.0, float("-inf")
    for span in sorted(thunks, key=lambda s: s.start_ns):
        total += max(0.0, span.end_ns - max(span.start_ns, reach))
        reach = max(reach, span.end_ns)
    return total / 1e9


def trace_events(profile) -> list[tuple[str, float, float]]:
    """The thunk events of a ``jax.profiler.ProfileData``: ``(hlo op name or "end: name", start, duration)``."""
    out = []
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith("end: ") or "hlo_op" in dict(event.stats):
                    out.append((event.name, event.start_ns, event.duration_ns))
    return out


def head_seconds(thunks: list[Span], hlo_text: str, tokens: int, hidden: int, vocab: int) -> dict[str, float]:
    """Seconds of every part of the step (the sum of its thunks' spans; control flow left out),
    ``grad_products_overlap`` (how long the two gradient products of the head ran at the same time) and
    ``covered`` (how long any thunk ran: against the step's wall time, what the trace did not see)."""
    table, members = instructions(hlo_text)
    parts: dict[str, list[Span]] = {}
    for span in thunks:
        parts.setdefault(classify(span.name, table, members, tokens, hidden, vocab), []).append(span)
    seconds = {part: sum(s.end_ns - s.start_ns for s in parts.get(part, [])) / 1e9 for part in (*HEAD_PARTS, "rest")}
    seconds["grad_products_overlap"] = overlap_s(parts.get("grad_hidden", []), parts.get("grad_weight", []))
    seconds["covered"] = covered_s([s for part, group in parts.items() if part != "control" for s in group])
    return seconds
