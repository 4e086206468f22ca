"""Packaging guard: pyproject.toml states the Python the pinned dependencies need and installs accelerator jax
through its extras, with torch (a test-only reference) kept out of every other install; the test command runs
whole files, the longest first."""

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
    assert "pytest-xdist>=3.8" in project()["optional-dependencies"]["test"]  # the first with --no-loadscope-reorder
    assert "pytest -q -n 2" in (root / ".ci" / "run").read_text()
    names = sorted(path.name for path in (root / "tests").glob("test_*.py"))
    assert set(conftest.LONGEST_FIRST) <= set(names)  # a file renamed or split is renamed here too
    assert sorted(names, key=conftest.file_rank)[:len(conftest.LONGEST_FIRST)] == list(conftest.LONGEST_FIRST)
    # the collection itself: a file of LONGEST_FIRST named last on the command line is collected first
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "tests/test_packaging.py",
                           "tests/test_distributed.py"], cwd=root, capture_output=True, text=True, timeout=120)
    files = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    assert files[0] == "tests/test_distributed.py" and files[-1] == "tests/test_packaging.py", done.stdout[-2000:]
