#!/usr/bin/env bash
# Create a Cloud TPU VM (one host) or pod slice (several hosts), directly or as a queued resource.
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE --accelerator-type TYPE [options]

Creates a TPU VM / pod slice for jppo.

  --name NAME               TPU name (e.g. jppo-v5e-32)
  --zone ZONE               e.g. us-west4-a
  --accelerator-type TYPE   e.g. v5litepod-32, v4-64
  --version VERSION         TPU software version (default: v2-alpha-tpuv5-lite for v5e, tpu-ubuntu2204-base otherwise)
  --project PROJECT         Google Cloud project (default: gcloud's)
  --queued                  create through a queued resource (waits for capacity)
  --spot                    spot / preemptible capacity
  --dry-run                 print the gcloud commands without running them
  -h, --help                this help
USAGE
}

NAME="" ZONE="" TYPE="" VERSION="" PROJECT="" QUEUED=0 SPOT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --accelerator-type) takes "$@"; TYPE=$2; shift 2 ;;
    --version) takes "$@"; VERSION=$2; shift 2 ;;
    --project) takes "$@"; PROJECT=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"; need accelerator-type "$TYPE"
require_gcloud
if [[ -z "$VERSION" ]]; then
  case "$TYPE" in
    v5litepod-*|v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    *) VERSION=tpu-ubuntu2204-base ;;
  esac
fi
extra=()
[[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
if [[ "$QUEUED" == 1 ]]; then
  [[ "$SPOT" == 1 ]] && extra+=(--spot)
  run gcloud compute tpus queued-resources create "$NAME" --node-id "$NAME" --zone "$ZONE" \
    --accelerator-type "$TYPE" --runtime-version "$VERSION" "${extra[@]}"
else
  [[ "$SPOT" == 1 ]] && extra+=(--spot)
  run gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$TYPE" \
    --version "$VERSION" "${extra[@]}"
fi
