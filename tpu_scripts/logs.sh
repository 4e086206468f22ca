#!/usr/bin/env bash
# Follow one worker's log of a run that launch.sh started (the run goes on when this stops).
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE [--worker N] [options]

Prints LOG_DIR/worker-N.log of worker N as it grows (tail -F over ssh); Ctrl-C stops following, not the run.

  --name NAME        TPU name
  --zone ZONE        its zone
  --worker N         which worker (default: 0, whose process logs the metrics)
  --log-dir PATH     log directory on the workers (default: ~/jppo-logs, as launch.sh)
  --project PROJECT  Google Cloud project (default: gcloud's)
  --dry-run          print the command without running it
  -h, --help         this help
USAGE
}

NAME="" ZONE="" WORKER=0 LOGS='~/jppo-logs' PROJECT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --worker) takes "$@"; WORKER=$2; shift 2 ;;
    --log-dir) takes "$@"; LOGS=$2; shift 2 ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"
[[ "$WORKER" =~ ^[0-9]+$ ]] || die "--worker $WORKER must be a worker number"
require_gcloud
follow_log "$NAME" "$ZONE" "$PROJECT" "$LOGS" "$WORKER"
