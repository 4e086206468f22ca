#!/usr/bin/env bash
# Multi-node launch without a scheduler: run this on every node with its own --process-id.
#
#   node 0:  tpu_scripts/multinode.sh --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0 CONFIG [overrides]
#   node 1:  tpu_scripts/multinode.sh --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 1 CONFIG [overrides]
#
# Every process must get the same CONFIG and overrides. The coordinator is process 0's address and a free port;
# the processes also meet on PORT + 1 first (jppo's rendezvous): open both, or add --rendezvous-port P or
# --rendezvous off right after CONFIG (before the overrides).
set -euo pipefail
usage() { echo "usage: $0 --coordinator HOST:PORT --num-processes N --process-id I CONFIG [key.sub=value ...]"; }
# takes OPTION [NEXT ...]: fail unless OPTION is followed by its value (not by another option).
takes() {
  if [[ $# -lt 2 || "$2" == --* ]]; then
    echo "$0: error: $1 needs a value" >&2
    exit 2
  fi
}
coordinator="" num="" id=""
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --coordinator) takes "$@"; coordinator=$2; shift 2 ;;
    --num-processes) takes "$@"; num=$2; shift 2 ;;
    --process-id) takes "$@"; id=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$0: error: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z "$coordinator" || -z "$num" || -z "$id" || $# -lt 1 ]]; then
  usage >&2
  exit 2
fi
config=$1
shift
exec python -m jppo.train --config "$config" --coordinator "$coordinator" --num-processes "$num" --process-id "$id" "$@"
