#!/usr/bin/env bash
# Set up every worker of a TPU VM: a Python >= 3.11 environment made with uv (the VM image's python3 is 3.10 on
# tpu-ubuntu2204-base, below jppo's floor), and jppo with its `tpu` extra in it, from a git URL or a local copy.
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE (--repo URL [--ref REF] | --copy DIR) [options]

Installs jppo on every worker of the TPU VM NAME.

  --name NAME        TPU name
  --zone ZONE        its zone
  --repo URL         git URL to clone on each worker
  --ref REF          branch, tag or commit to check out (default: main)
  --copy DIR         instead of cloning: copy this local checkout to every worker (gcloud scp)
  --dir PATH         where the code goes on the workers (default: ~/jppo)
  --venv PATH        the Python environment made on the workers, which launch.sh uses (default: ~/jppo-venv)
  --python VERSION   its Python, installed by uv (default: 3.12: the jax 0.11 line; 3.11: the jax 0.10 line)
  --gcs-data URI     optional gs:// prefix whose contents are copied into --data-dir on every worker
  --data-dir PATH    destination of --gcs-data (default: ~/data)
  --project PROJECT  Google Cloud project (default: gcloud's)
  --dry-run          print the commands without running them
  -h, --help         this help
USAGE
}

NAME="" ZONE="" REPO="" REF="main" COPY="" DIR='~/jppo' GCS="" DATA='~/data' PROJECT="" VENV=$DEFAULT_VENV PYTHON=3.12
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --repo) takes "$@"; REPO=$2; shift 2 ;;
    --ref) takes "$@"; REF=$2; shift 2 ;;
    --copy) takes "$@"; COPY=$2; shift 2 ;;
    --dir) takes "$@"; DIR=$2; shift 2 ;;
    --venv) takes "$@"; VENV=$2; shift 2 ;;
    --python) takes "$@"; PYTHON=$2; shift 2 ;;
    --gcs-data) takes "$@"; GCS=$2; shift 2 ;;
    --data-dir) takes "$@"; DATA=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"
if [[ -z "$REPO" && -z "$COPY" ]] || [[ -n "$REPO" && -n "$COPY" ]]; then
  die "give exactly one of --repo URL or --copy DIR"
fi
[[ -n "$COPY" && ! -f "$COPY/pyproject.toml" ]] && die "--copy $COPY is not a jppo checkout (no pyproject.toml)"
[[ "$PYTHON" =~ ^3\.(1[1-9]|[2-9][0-9])$ ]] || die "--python $PYTHON: jppo needs Python 3.11 or later (e.g. 3.12)"
require_gcloud
extra=()
[[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
if [[ -n "$COPY" ]]; then
  run gcloud compute tpus tpu-vm scp --recurse "$COPY" "$NAME:$DIR" --zone "$ZONE" "${extra[@]}" --worker=all
  fetch="true"
else
  fetch="(test -d $DIR/.git || git clone $REPO $DIR) && git -C $DIR fetch --all && git -C $DIR checkout $REF"
fi
# uv from PyPI with the image's pip (into ~/.local/bin); uv installs the Python it is asked for, makes the
# environment, and installs jppo's `tpu` extra (jax[tpu] of the jax line that Python selects) into it.
install="python3 -m pip install --user --quiet --upgrade uv && export PATH=\$HOME/.local/bin:\$PATH"
install+=" && uv venv --allow-existing --python $PYTHON $VENV && uv pip install --python $VENV/bin/python -e $DIR'[tpu]'"
install+=" && $VENV/bin/python -c 'import jax, jppo; print(jax.__version__)'"
ssh_all "$NAME" "$ZONE" "$PROJECT" "set -e; $fetch; $install"
if [[ -n "$GCS" ]]; then
  ssh_all "$NAME" "$ZONE" "$PROJECT" "mkdir -p $DATA && gcloud storage rsync --recursive ${GCS%/} $DATA"
fi
