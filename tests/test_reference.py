"""The configuration reference: docs/configuration.md is what ``python -m jppo.config.reference`` writes from the
schema today, every key's meaning comes from the source, and the generator finds it where the source puts it."""

import dataclasses
import pathlib
from typing import Optional

import pytest

from jppo.config import reference

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_committed_reference_is_the_generated_one():
    if PAGE.read_text() != reference.render():
        pytest.fail(f"docs/configuration.md differs from the schema: run `{reference.COMMAND}`", pytrace=False)


def test_every_key_has_a_meaning():
    missing = sorted(key.name for key in reference.keys() if not key.meaning)
    assert not missing, f"keys with no meaning in the source: {missing}"


@dataclasses.dataclass(frozen=True)
class _Inner:
    """A nested section.

    Attributes:
        listed: said under Attributes,
            on two lines.
    """

    listed: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])


@dataclasses.dataclass(frozen=True)
class _Mixin:
    """``told`` is said in a sentence of the docstring. Another sentence names ``told`` again."""

    trailing: int = 1  # said at the end of its line
    # said above it,
    # on two lines
    above: str = "x"
    told: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class _Section(_Mixin):
    """A section made of a mixin, a nested section and a key nothing explains."""

    inner: _Inner = dataclasses.field(default_factory=_Inner)
    silent: bool = True


def test_meanings_come_from_the_class_that_declares_the_key():
    found = {key.name: key for key in reference.keys(_Section, "s.")}
    assert list(found) == ["s.trailing", "s.above", "s.told", "s.inner.listed", "s.silent"]
    assert found["s.trailing"] == reference.Key("s.trailing", "int", "1", "said at the end of its line")
    assert found["s.above"].meaning == "said above it, on two lines"
    assert found["s.told"] == reference.Key("s.told", "float | None", "null",
                                            "`told` is said in a sentence of the docstring.")
    assert found["s.inner.listed"][1:] == ("list[str]", "[a, b]", "said under Attributes, on two lines.")
    assert found["s.silent"].meaning == ""
