#!/usr/bin/env bash
# Create a Cloud TPU VM (one host) or pod slice (several hosts), directly or as a queued resource; a queued resource
# is polled until it is ACTIVE (its VMs exist) before the script returns, so setup.sh can follow it at once.
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE --accelerator-type TYPE [options]

Creates a TPU VM / pod slice for jppo.

  --name NAME               TPU name (e.g. jppo-v5e-32)
  --zone ZONE               e.g. us-west4-a
  --accelerator-type TYPE   e.g. v5litepod-32, v4-64
  --version VERSION         TPU software (runtime) version; default by generation, as the Cloud TPU docs name them:
                            v6e: v2-alpha-tpuv6e, v5p: v2-alpha-tpuv5, v5e: v2-alpha-tpuv5-lite,
                            v4, v3, v2: tpu-ubuntu2204-base (another generation: give --version)
  --project PROJECT         Google Cloud project (default: gcloud's)
  --queued                  create through a queued resource (waits for capacity), then wait until it is ACTIVE
  --wait-timeout SECONDS    give up waiting for ACTIVE after this long (default 7200; 0: do not wait)
  --spot                    spot / preemptible capacity
  --dry-run                 print the gcloud commands without running them
  -h, --help                this help
USAGE
}

NAME="" ZONE="" TYPE="" VERSION="" PROJECT="" QUEUED=0 SPOT=0 WAIT=7200
POLL_SECONDS=${JPPO_TPU_POLL_SECONDS:-30}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --accelerator-type) takes "$@"; TYPE=$2; shift 2 ;;
    --version) takes "$@"; VERSION=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --wait-timeout) takes "$@"; WAIT=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"; need accelerator-type "$TYPE"
[[ "$WAIT" =~ ^[0-9]+$ ]] || die "--wait-timeout $WAIT must be a number of seconds"
if [[ -z "$VERSION" ]]; then
  case "$TYPE" in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v5litepod-*|v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v4-*|v3-*|v2-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "no default software version for --accelerator-type $TYPE: give --version (see the Cloud TPU docs' runtime versions)" ;;
  esac
fi
require_gcloud
extra=()
[[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
if [[ "$QUEUED" == 1 ]]; then
  [[ "$SPOT" == 1 ]] && extra+=(--spot)
  run gcloud compute tpus queued-resources create "$NAME" --node-id "$NAME" --zone "$ZONE" \
    --accelerator-type "$TYPE" --runtime-version "$VERSION" "${extra[@]}"
  [[ "$WAIT" == 0 ]] && exit 0
  describe=(gcloud compute tpus queued-resources describe "$NAME" --zone "$ZONE" --format='value(state.state)')
  [[ -n "$PROJECT" ]] && describe+=(--project "$PROJECT")
  run "${describe[@]}"  # printed once; with --dry-run, that is all
  [[ "$DRY_RUN" == 1 ]] && exit 0
  deadline=$((SECONDS + WAIT))
  while true; do
    state=$("${describe[@]}")
    case "$state" in
      ACTIVE) echo "$(basename "$0"): $NAME is ACTIVE"; exit 0 ;;
      FAILED|SUSPENDED|SUSPENDING|DELETING) die "queued resource $NAME is $state (gcloud compute tpus queued-resources describe $NAME --zone $ZONE)" ;;
    esac
    ((SECONDS < deadline)) || die "queued resource $NAME is still ${state:-unknown} after --wait-timeout $WAIT s"
    echo "$(basename "$0"): $NAME is ${state:-unknown}; waiting for ACTIVE" >&2
    sleep "$POLL_SECONDS"
  done
else
  [[ "$SPOT" == 1 ]] && extra+=(--spot)
  run gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$TYPE" \
    --version "$VERSION" "${extra[@]}"
fi
