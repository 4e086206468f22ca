#!/usr/bin/env bash
# The wheels bench/device_check.sh installs from on an image that has its own jax but not the rest of jppo's
# dependencies: run here (where the package registry is reachable), then carry bench/device_check/wheels with the
# working tree to the machine without network.
#
#   bash bench/device_check/wheels.sh [PYTHON_VERSION]    # default 3.12 (the jax 0.11 line's images)
#
# Every dependency of jppo for that Python, with theirs, as manylinux x86_64 wheels, except jax, jaxlib and the
# CUDA / TPU plugins (the image's own are used: never a second jax), what a jax image already has (numpy, scipy,
# ml_dtypes, opt_einsum), and matplotlib with its own dependencies (24 MB; only trainer.plots needs it, and the
# check runs with plots off). Prints the folder's size: a carried working tree holds 64 MiB in all (42 MB for
# Python 3.12 when this was written; tensorstore, orbax's, is half of it).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
dest=bench/device_check/wheels
mkdir -p "$dest"
requirements=$(python3 - "$version" <<'PYEOF'
import sys, tomllib
here = repr(sys.argv[1])
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    spec, _, marker = requirement.partition(";")
    if marker and not eval(marker.replace("python_version", here)):
        continue
    print(spec.strip())  # jax and jaxlib too, so that the others resolve against that line (removed below)
PYEOF
)
# shellcheck disable=SC2086
python3 -m pip download --dest "$dest" --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any $requirements
rm -f "$dest"/jax-[0-9]*.whl "$dest"/jaxlib-*.whl "$dest"/jax_cuda*.whl "$dest"/libtpu*.whl "$dest"/nvidia_*.whl \
  "$dest"/numpy-*.whl "$dest"/scipy-*.whl "$dest"/ml_dtypes-*.whl "$dest"/opt_einsum-*.whl \
  "$dest"/matplotlib-*.whl "$dest"/pillow-*.whl "$dest"/fonttools-*.whl "$dest"/kiwisolver-*.whl \
  "$dest"/contourpy-*.whl "$dest"/cycler-*.whl
du -sh "$dest"
