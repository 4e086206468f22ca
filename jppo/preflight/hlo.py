"""Reading a compiled program's text (``executable.as_text()``, XLA's HLO after partitioning): its collectives and
its matrix-product flops, as executed, with each loop's body counted as many times as the loop runs.

XLA's own ``cost_analysis()`` counts a loop's body once (the layer scan, the micro-batches, the attention blocks)
and is empty on GPU; here a ``while`` whose trip count is fixed multiplies its body and its condition: the count
XLA recorded (``known_trip_count``), or read off a condition that compares the loop's counter with a constant
(``counter < N``, from the counter's constant start: every ``lax.scan`` and ``fori_loop``). A loop whose count
depends on the data (the decoding loop, which stops when every row has ended) counts once for the collectives,
and ``unknown_trips`` times for the flops (None: no flops). A conditional counts its costliest branch (an update's
micro-batch without tokens skips its model, the first K - 1 micro-batches skip the optimizer: the figures are those of
full micro-batches).

Flops are those of matrix products (``dot``, ``convolution``, the GPU's library GEMMs and the TPU's grouped
product of ``jax.lax.ragged_dot``, counted for every row of its buffer): ``2 x output elements x contracted size``,
per device; elementwise work is left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from typing import Optional

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "ragged-all-to-all", "collective-broadcast")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
DIMS = re.compile(r"^\(?\s*\w+\[([\d,]*)\]")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: str
    operands: list
    attributes: str  # what follows the operands
    attributes_in: str = ""  # the text between the parentheses (a constant's value)
    root: bool = False


@dataclasses.dataclass
class Module:
    computations: dict  # name -> [Instruction]
    entry: str
    shapes: dict  # instruction name -> its shape text
    instructions: dict  # instruction name -> [Instruction] (names repeat across computations: every one)


def _split_shape(rest: str) -> tuple[str, str]:
    """``rest`` of an instruction line -> ``(shape, "opcode(...)...")``; a tuple shape is in parentheses."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _operands(call: str) -> tuple[list, str, str]:
    """``opcode(a, b), attrs`` -> operand names, the attributes after the closing parenthesis, and the text
    inside the parentheses."""
    depth, start = 0, call.index("(")
    for i in range(start, len(call)):
        depth += {"(": 1, ")": -1}.get(call[i], 0)
        if depth == 0:
            inside = call[start + 1 : i]
            return re.findall(r"%([\w.\-]+)", inside), call[i + 1 :], inside
    return [], "", ""


def parse(text: str) -> Module:
    """The computations of an HLO module's text, each a list of its instructions."""
    computations, shapes, instructions, entry, current = {}, {}, {}, None, None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            current = computations.setdefault(header["name"], [])
            entry = header["name"] if header.group(1) else entry
            continue
        match = INSTRUCTION.match(line) if current is not None else None
        if match is None:
            continue
        shape, call = _split_shape(match["rest"])
        opcode = call.split("(", 1)[0].strip()
        operands, attributes, inside = _operands(call) if "(" in call else ([], "", "")
        shapes[match["name"]] = shape
        instruction = Instruction(match["name"], opcode, shape, operands, attributes, inside, bool(match.group(1)))
        current.append(instruction)
        instructions.setdefault(match["name"], []).append(instruction)
    return Module(computations, entry, shapes, instructions)


def dims(shape: str) -> list[int]:
    match = DIMS.match(shape)
    return [int(d) for d in match[1].split(",") if d] if match else []


def _constant(module: Module, name: str) -> Optional[int]:
    """The value of a scalar integer constant instruction ``name`` (None: not one)."""
    for instruction in module.instructions.get(name, ()):
        if instruction.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", instruction.shape.split("{")[0]):
            found = re.search(r"constant\((-?\d+)\)", f"constant({instruction.attributes_in})")
            return int(found[1]) if found else None
    return None


def trip_count(module: Module, instruction: Instruction) -> Optional[int]:
    """How many times the ``while`` ``instruction`` runs, when that does not depend on the data."""
    match = TRIP_COUNT.search(instruction.attributes)
    if match:
        return int(match[1])
    condition = re.search(r"condition=%([\w.\-]+)", instruction.attributes)
    test = module.computations.get(condition[1], []) if condition else []
    root = next((line for line in test if line.root), test[-1] if test else None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
        return None
    counter = next((i for i in test if i.name == root.operands[0]), None)
    limit = _constant(module, root.operands[1])
    if counter is None or counter.opcode != "get-tuple-element" or limit is None:
        return None
    index = int(re.search(r"index=(\d+)", counter.attributes)[1])
    init = next((i for i in module.instructions.get(instruction.operands[0], ()) if i.opcode == "tuple"), None)
    start = _constant(module, init.operands[index]) if init is not None and index < len(init.operands) else None
    return limit - (start or 0)


def _collective(opcode: str) -> Optional[str]:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None


def _own_flops(module: Module, instruction: Instruction) -> float:
    """Flops of one matrix product: 2 x output elements x contracted size."""
    out = dims(instruction.shape)
    if instruction.opcode == "dot":
        lhs = dims(module.shapes.get(instruction.operands[0], ""))
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
        contracted = [lhs[int(i)] for i in found[1].split(",") if i] if found and lhs else []
        return 2.0 * math.prod(out) * math.prod(contracted)
    if instruction.opcode == "convolution":
        return _convolution_flops(module, instruction, out)
    if instruction.opcode == "custom-call" and "ragged_dot_tiling=" in instruction.attributes:
        # XLA:TPU's grouped product (jax.lax.ragged_dot): a Mosaic kernel of [M, K] rows by [G, K, N] groups, its
        # operands the tile schedule's metadata and then those two: every row against its group's [K, N]
        lhs = dims(module.shapes.get(instruction.operands[-2], "")) if len(instruction.operands) >= 2 else []
        return 2.0 * math.prod(out) * lhs[-1] if len(lhs) == 2 else 0.0
    if instruction.opcode == "custom-call" and any(f'"{t}"' in instruction.attributes for t in GEMM_TARGETS):
        lhs = dims(module.shapes.get(instruction.operands[0], ""))
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
        contracted = [lhs[int(i)] for i in json.loads(f"[{found[1]}]")] if found and lhs else []
        return 2.0 * math.prod(out) * math.prod(contracted)
    return 0.0


def _window(window: str, key: str, default: int, rank: int) -> list[int]:
    """One field of a convolution's ``window={size=4x8 lhs_dilate=4x8 ...}``, one integer per spatial dimension."""
    found = re.search(rf"\b{key}=([\dx]+)", window)
    return [int(n) for n in found[1].split("x")] if found else [default] * rank


def _taps(out_size: int, size: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int, in_size: int) -> int:
    """The (output position, window position) pairs of one spatial dimension that meet a real input element (not
    padding, not a hole of a dilated input): XLA writes a product with batch dimensions as such a convolution."""
    dilated = (in_size - 1) * lhs_dilate + 1
    if out_size * size > 1 << 20:  # a true convolution's long dimension: every tap but the dilation's holes
        return out_size * -(-size // lhs_dilate)
    taps = 0
    for o in range(out_size):
        for k in range(size):
            p = o * stride + k * rhs_dilate - pad_low
            taps += 0 <= p < dilated and p % lhs_dilate == 0
    return taps


def _convolution_flops(module: Module, instruction: Instruction, out: list[int]) -> float:
    """2 x (output elements outside the spatial dimensions) x input features x the taps of each spatial
    dimension (:func:`_taps`)."""
    lhs, kernel = (dims(module.shapes.get(name, "")) for name in instruction.operands[:2])
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    if not labels or (len(labels[1]), len(labels[2]), len(labels[3])) != (len(lhs), len(kernel), len(out)):
        return 0.0
    lhs_labels, kernel_labels, out_labels = labels[1], labels[2], labels[3]
    spatial = sorted(label for label in out_labels if label.isdigit())
    found = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    window, rank = (found[1] if found else ""), len(spatial)
    sizes, strides = _window(window, "size", 1, rank), _window(window, "stride", 1, rank)
    lhs_dilate, rhs_dilate = _window(window, "lhs_dilate", 1, rank), _window(window, "rhs_dilate", 1, rank)
    pads = re.search(r"\bpad=([\d_x-]+)", window)
    pad_low = [int(p.split("_")[0]) for p in pads[1].split("x")] if pads else [0] * rank
    taps = 1
    for d, label in enumerate(spatial):
        taps *= _taps(out[out_labels.index(label)], sizes[d], strides[d], pad_low[d], lhs_dilate[d],
                      rhs_dilate[d], lhs[lhs_labels.index(label)])
    others = math.prod(n for n, label in zip(out, out_labels) if not label.isdigit())
    features = math.prod(n for n, label in zip(kernel, kernel_labels) if label == "i")
    return 2.0 * others * features * taps


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    """``(kind, computation)`` of what ``instruction`` runs; kind ``branch`` for a conditional's branches."""
    if instruction.opcode in ("async-update", "async-done"):  # the async-start's computation, counted there
        return []
    found = CALLEES.findall(instruction.attributes)
    found = [("branch" if kind.endswith("_computation") else kind, name) for kind, name in found]
    for group in BRANCHES.findall(instruction.attributes):
        found += [("branch", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return found


def _count(
    module: Module, computation: str, unknown_trips: Optional[int], memo: dict
) -> tuple[Counter, Optional[float]]:
    """``(collectives, flops)`` of one run of ``computation`` (see the module docstring)."""
    if computation in memo:
        return memo[computation]
    collectives, flops = Counter(), 0.0
    for instruction in module.computations.get(computation, ()):
        kind = _collective(instruction.opcode)
        if kind:
            collectives[kind] += 1
        flops = None if flops is None else flops + _own_flops(module, instruction)
        callees = _callees(instruction)
        branches = [_count(module, name, unknown_trips, memo) for kind, name in callees if kind == "branch"]
        if branches:
            most = max(branches, key=lambda b: (sum(b[0].values()), b[1] or 0.0))
            collectives += most[0]
            flops = (
                None if flops is None or any(b[1] is None for b in branches) else flops + max(b[1] for b in branches)
            )
        for kind, name in callees:
            if kind == "branch":
                continue
            inner, inner_flops = _count(module, name, unknown_trips, memo)
            loop = kind in ("body", "condition")
            times = trip_count(module, instruction) if loop else 1
            if loop and times is None:
                collectives += inner
                times = unknown_trips
            else:
                collectives += Counter({op: n * times for op, n in inner.items()})
            flops = None if flops is None or inner_flops is None or times is None else flops + inner_flops * times
    memo[computation] = (collectives, flops)
    return memo[computation]


def collectives(module: Module) -> dict[str, int]:
    """The collectives the program executes, by kind (module docstring: loops multiplied out, a loop of unknown
    count once)."""
    return dict(sorted(_count(module, module.entry, None, {})[0].items()))


def flops(module: Module, unknown_trips: Optional[int] = None) -> Optional[float]:
    """Matrix-product flops per device of one run of the program; a loop of unknown count runs ``unknown_trips``
    times (None: the flops are not known, None)."""
    return _count(module, module.entry, unknown_trips, {})[1]


def data_dependent_loops(module: Module, computation: Optional[str] = None) -> list[Instruction]:
    """The outermost ``while`` loops whose trip count depends on the data (the decoding loop)."""
    found = []
    for instruction in module.computations.get(computation or module.entry, ()):
        for kind, name in _callees(instruction):
            if kind == "body" and trip_count(module, instruction) is None:
                found.append(instruction)
            elif kind != "to_apply":
                found += data_dependent_loops(module, name)
    return found


def decode_step_collectives(module: Module) -> dict[str, int]:
    """The collectives of one turn of the decoding loop: one decoded token of every row it decodes."""
    total, memo = Counter(), {}
    for loop in data_dependent_loops(module):
        for kind, name in _callees(loop):
            total += _count(module, name, None, memo)[0]  # its body and its condition (one test per turn)
    return dict(sorted(total.items()))
