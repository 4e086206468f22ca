#!/usr/bin/env bash
# Launch the same training command on every worker of a TPU VM, detached from the ssh session (setsid nohup: a
# dropped connection does not end the run), from the environment setup.sh made, with the flags of xla_flags.sh;
# each worker logs to its own file (follow one with --follow here, or logs.sh later).
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE --config CONFIG [options] [-- key.sub=value ...]

Starts "VENV/bin/python -m jppo.train --config CONFIG --distributed auto [overrides]" on every worker at once
(JAX finds its peers on a TPU pod by itself), detached: the run goes on when this script or its ssh ends. Each
worker writes its output to LOG_DIR/worker-<id>.log and its process id to LOG_DIR/worker-<id>.pid on that worker.
A run stopped by SIGTERM or SIGUSR1 after a checkpoint (exit status 75) starts again there and resumes from it
(tpu_scripts/resume_loop.sh), unless delete.sh --stop-only stopped it. After a spot VM's preemption, create.sh,
setup.sh and this script again resume the run from its newest checkpoint (trainer.output_dir on gs://).
Overrides are passed to the workers as written: quote a \$HOME or ~ in them so that each worker expands it
('model.path=\$HOME/qwen'), not this machine.

  --name NAME        TPU name
  --zone ZONE        its zone
  --config CONFIG    config path relative to the code directory (e.g. configs/qwen2_5_0_5b_gsm8k_grpo.yaml)
  --dir PATH         code directory on the workers (default: ~/jppo)
  --venv PATH        the Python environment on the workers (default: ~/jppo-venv, what setup.sh makes)
  --log-dir PATH     log directory on the workers (default: ~/jppo-logs)
  --follow [WORKER]  after starting, print worker WORKER's log as it grows (default 0; Ctrl-C stops following only)
  --collect DIR      copy every worker's log (as it is now) into this local directory
  --background       (the default) return once every worker has started
  --project PROJECT  Google Cloud project (default: gcloud's)
  --dry-run          print the commands without running them
  -h, --help         this help
USAGE
}

NAME="" ZONE="" CONFIG="" DIR='~/jppo' LOGS='~/jppo-logs' COLLECT="" FOLLOW="" PROJECT="" VENV=$DEFAULT_VENV
OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --config) takes "$@"; CONFIG=$2; shift 2 ;;
    --dir) takes "$@"; DIR=$2; shift 2 ;;
    --venv) takes "$@"; VENV=$2; shift 2 ;;
    --log-dir) takes "$@"; LOGS=$2; shift 2 ;;
    --follow)
      if [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]]; then FOLLOW=$2; shift 2; else FOLLOW=0; shift; fi ;;
    --collect) takes "$@"; COLLECT=$2; shift 2 ;;
    --background) shift ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) common_option "$@"; shift "$SHIFT_BY" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"; need config "$CONFIG"
require_gcloud
quoted=""
# Quoted for the workers' shell, except \$: a $HOME or $USER in an override is the worker's (the README's
# 'model.path=$HOME/qwen', in single quotes so that this machine's shell leaves it alone).
for item in "${OVERRIDES[@]}"; do
  item=$(printf '%q' "$item")
  quoted+=" ${item//\\\$/\$}"
done
worker='$(hostname | sed -E "s/.*-w-([0-9]+)$/\1/")'
log="$LOGS/worker-$worker"
train="$VENV/bin/python -m jppo.train --config $CONFIG --distributed auto$quoted"
# setsid: a new session, so the ssh's hang-up never reaches the run; nohup and </dev/null: no terminal either.
start="cd $DIR && mkdir -p $LOGS && source tpu_scripts/xla_flags.sh"
# resume_loop.sh: exit status 75 (stopped on a signal, checkpointed) starts the run again: it resumes
start+=" && rm -f $log.stop && { setsid nohup bash tpu_scripts/resume_loop.sh $log.stop $train > $log.log 2>&1 < /dev/null & echo \$! > $log.pid; }"
start+=" && echo \"worker $worker: started, pid \$(cat $log.pid), log $log.log\""
ssh_all "$NAME" "$ZONE" "$PROJECT" "$start"
[[ -n "$FOLLOW" ]] && { follow_log "$NAME" "$ZONE" "$PROJECT" "$LOGS" "$FOLLOW" || true; }
if [[ -n "$COLLECT" ]]; then
  extra=()
  [[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
  run mkdir -p "$COLLECT"
  run gcloud compute tpus tpu-vm scp "$NAME:$LOGS/*.log" "$COLLECT/" --zone "$ZONE" "${extra[@]}" --worker=all
fi
