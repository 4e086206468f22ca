"""``reward.kind: math_verify``: boxed answers compared as mathematics by the optional package ``math-verify``.

The response's answer is the content of its last ``\\boxed{}`` (as for ``reward.kind: boxed``); the reference is the
content of the answer's last ``\\boxed{}`` or, without one, the whole answer. math-verify parses both into SymPy
and compares them symbolically and numerically, so ``\\frac12`` equals ``0.5``, ``x=3`` equals ``3`` and ``\\sqrt2``
equals ``\\sqrt{2}``, which the text rule of ``boxed`` misses. Score: 1.0 when math-verify says they are equal, else
0.0; no boxed answer, a parse error or a timeout scores 0.0.

Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which works only in the main thread. On
the main thread each call is bounded by :data:`TIMEOUT_SECONDS`; on any other thread the timeout is switched off
(``parsing_timeout=None``, ``timeout_seconds=None``), so there a pathological expression can take long.
"""

from __future__ import annotations

import importlib.util
import threading

import jppo.rewards.rules as rules  # the module, not the package: its __init__ imports this one

TIMEOUT_SECONDS = 5


def require_math_verify() -> None:
    """Refuses ``reward.kind: math_verify`` without the package (looked up, not imported: SymPy is slow to load)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ValueError("reward.kind='math_verify' needs the package math-verify: pip install 'jppo[math]'")


def _timeout() -> int | None:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def math_verify_score(response: str, answer: str) -> float:
    """1.0 if the response's last ``\\boxed{}`` is mathematically equal to the reference, else 0.0 (never raises)."""
    from math_verify import parse, verify  # noqa: PLC0415 (optional; the config check names the extra)

    predicted = rules.extract_boxed(response)
    if predicted is None:
        return 0.0
    reference = rules.extract_boxed(answer)
    reference = answer.strip() if reference is None else reference
    timeout = _timeout()
    try:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
        target = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        return float(bool(gold) and bool(target) and verify(gold, target, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 (an unparsable or runaway answer is a wrong answer, not a crashed run)
        return 0.0
