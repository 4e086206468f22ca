#!/usr/bin/env bash
# resume_loop.sh STOP_FILE COMMAND...: runs COMMAND (a jppo.train command) again each time it exits 75, the status
# of a run stopped by SIGTERM or SIGUSR1 after a checkpoint (jppo.parallel.preemption.PREEMPTED_EXIT), so that
# trainer.resume: auto continues it from that checkpoint; stops once STOP_FILE exists (delete.sh --stop-only
# creates it before it signals the run) or COMMAND ends with any other status, which it exits with.
set -uo pipefail
PREEMPTED_EXIT=75
stop=$1
shift
while true; do
  "$@"
  status=$?
  echo "$(basename "$0"): exit status $status"
  if [[ $status != "$PREEMPTED_EXIT" || -e "$stop" ]]; then
    exit "$status"
  fi
  echo "$(basename "$0"): preempted after a checkpoint: starting again to resume"
done
