"""Rule-based answer checks: GSM8K-style final numbers and LaTeX ``\\boxed{}`` answers. Pure functions of text.

GSM8K (``reward.kind: gsm8k``):

- strict (default): the response's answer is the number right after its LAST ``####`` (spaces and one ``$`` may
  come between); no ``####`` followed by a number means no answer, reward 0;
- flexible (``reward.gsm8k_flexible: true``): the last number anywhere in the response;
- the reference is the number after the last ``####`` of the example's answer (GSM8K keeps the worked solution
  before it), or the whole answer when it has no ``####``;
- numbers compare by value after removing thousands commas: ``"1,000" == "1000.0"``, ``"-3" != "3"``. verl
  compares the extracted strings (so ``"72.0"`` misses ``"72"``) and reads only the last 300 characters; jppo
  compares values and reads the whole response.

Boxed (``reward.kind: boxed``): the content of the last ``\\boxed{...}`` with balanced braces (so
``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``), against the reference's own last ``\\boxed{}`` or, if it has
none, the whole reference. Both sides are normalised by :func:`normalize_math`; they match when both parse as
numbers of equal value, or are equal as text.
"""

from __future__ import annotations

import decimal
import re
from typing import Optional

_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_AFTER_MARKER_RE = re.compile(r"\s*\$?\s*(" + _NUMBER + ")")
_BOXED_OPEN_RE = re.compile(r"\\boxed\s*\{")
GSM8K_MARKER = "####"


def parse_number(text: str) -> Optional[decimal.Decimal]:
    """The value of a plain number with optional thousands commas (``"-1,234.5"``), else ``None``."""
    cleaned = text.replace(",", "").strip()
    if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)", cleaned):
        return None
    return decimal.Decimal(cleaned)


def extract_gsm8k_answer(text: str, flexible: bool = False) -> Optional[str]:
    """The final-answer number of ``text`` with commas removed (strict: after the last ``####``), or ``None``."""
    if flexible:
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    marker = text.rfind(GSM8K_MARKER)
    if marker < 0:
        return None
    match = _AFTER_MARKER_RE.match(text, marker + len(GSM8K_MARKER))
    return match.group(1).replace(",", "") if match else None


def gsm8k_reference(answer: str) -> decimal.Decimal:
    """The reference value of a GSM8K answer; a reference without a number is a data error, not a zero reward."""
    reference = extract_gsm8k_answer(answer) if GSM8K_MARKER in answer else answer.strip()
    value = parse_number(reference) if reference is not None else None
    if value is None:
        raise ValueError(f"reference answer {answer[-60:]!r} has no final number for reward.kind=gsm8k")
    return value


def gsm8k_score(response: str, answer: str, flexible: bool = False) -> float:
    """1 if the response's final number equals the reference's, else 0."""
    reference = gsm8k_reference(answer)
    predicted = extract_gsm8k_answer(response, flexible)
    return float(predicted is not None and parse_number(predicted) == reference)


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced), or ``None`` if there is none or it never closes."""
    opens = list(_BOXED_OPEN_RE.finditer(text))
    if not opens:
        return None
    start = opens[-1].end()
    depth = 1
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return None


_LATEX_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^{\\circ}", "^\\circ", "\\%", "%", "\\$", "$")


def normalize_math(text: str) -> str:
    """A canonical spelling of a short math answer: no spacing commands, ``$``, ``%``, degrees, ``\\left``/``\\right``
    or whitespace; ``\\text{x}`` becomes ``x``; ``\\dfrac``/``\\tfrac`` become ``\\frac``; no trailing period."""
    text = _LATEX_WRAPPER_RE.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _REMOVED:
        text = text.replace(token, "")
    return re.sub(r"\s+", "", text).rstrip(".")


def math_equal(predicted: str, reference: str) -> bool:
    """Equal after :func:`normalize_math`, by numeric value when both are numbers, else as text."""
    predicted, reference = normalize_math(predicted), normalize_math(reference)
    predicted_value, reference_value = parse_number(predicted), parse_number(reference)
    if predicted_value is not None and reference_value is not None:
        return predicted_value == reference_value
    return predicted == reference


def boxed_score(response: str, answer: str) -> float:
    """1 if the response's last ``\\boxed{}`` matches the reference, else 0 (no boxed answer scores 0)."""
    predicted = extract_boxed(response)
    reference = extract_boxed(answer)
    return float(predicted is not None and math_equal(predicted, answer if reference is None else reference))
