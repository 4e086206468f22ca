"""Packaging guard: pyproject.toml states the Python the pinned dependencies need and installs accelerator jax
through its extras, with torch (a test-only reference) kept out of every other install."""

import pathlib
import re
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_requires_python_is_at_least_3_11():
    minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", project()["requires-python"].strip())
    assert minimum is not None and tuple(map(int, minimum.groups())) >= (3, 11)


def test_accelerator_extras_pin_jax_and_torch_is_only_for_tests():
    extras = project()["optional-dependencies"]
    for extra in ("cuda12", "tpu"):
        assert extras[extra] == [f"jax[{extra}]>=0.10.2,<0.11"]
        assert f"'.[{extra}]'" in (PYPROJECT.parent / "README.md").read_text()
    with_torch = {name for name, deps in extras.items() if any(re.match(r"torch\b", d) for d in deps)}
    assert with_torch == {"test"}
    assert not any(re.match(r"torch\b", d) for d in project()["dependencies"])
