#!/usr/bin/env bash
# Stop the training processes and delete a TPU VM (or its queued resource).
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE [--queued] [--stop-only] [options]

  --name NAME        TPU name
  --zone ZONE        its zone
  --queued           it was created as a queued resource (deletes that too)
  --stop-only        only stop the jppo processes on every worker (SIGTERM: they save a checkpoint at the end
                     of the step and exit; launch.sh does not start them again); keep the VM
  --project PROJECT  Google Cloud project (default: gcloud's)
  --dry-run          print the commands without running them
  -h, --help         this help
USAGE
}

NAME="" ZONE="" QUEUED=0 STOP_ONLY=0 PROJECT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --stop-only) STOP_ONLY=1; shift ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"
require_gcloud
# launch.sh's stop files first (its default LOG_DIR): a run stopped by this signal is not started again
stop='for f in ~/jppo-logs/worker-*.log; do [ -e "$f" ] && touch "${f%.log}.stop"; done'
ssh_all "$NAME" "$ZONE" "$PROJECT" "$stop; pkill -f 'jppo.train' || true"
[[ "$STOP_ONLY" == 1 ]] && exit 0
extra=(--quiet)
[[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
if [[ "$QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$NAME" --zone "$ZONE" --force "${extra[@]}"
else
  run gcloud compute tpus tpu-vm delete "$NAME" --zone "$ZONE" "${extra[@]}"
fi
