#!/usr/bin/env bash
# Launch the same training command on every worker of a TPU VM; logs are kept per worker.
source "$(dirname "$0")/common.sh"

usage() {
  cat <<USAGE
usage: $(basename "$0") --name NAME --zone ZONE --config CONFIG [options] [-- key.sub=value ...]

Runs "python -m jppo.train --config CONFIG --distributed auto [overrides]" on every worker at once (JAX finds its
peers on a TPU pod by itself). Each worker writes its output to LOG_DIR/worker-<id>.log on that worker;
--collect copies them back afterwards.

  --name NAME        TPU name
  --zone ZONE        its zone
  --config CONFIG    config path relative to the code directory (e.g. configs/qwen2_5_0_5b_gsm8k_grpo.yaml)
  --dir PATH         code directory on the workers (default: ~/jppo)
  --log-dir PATH     log directory on the workers (default: ~/jppo-logs)
  --collect DIR      after the run, copy every worker's log into this local directory
  --background       start detached (nohup) and return at once
  --project PROJECT  Google Cloud project (default: gcloud's)
  --dry-run          print the commands without running them
  -h, --help         this help
USAGE
}

NAME="" ZONE="" CONFIG="" DIR='~/jppo' LOGS='~/jppo-logs' COLLECT="" BACKGROUND=0 PROJECT=""
OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) takes "$@"; NAME=$2; shift 2 ;;
    --zone) takes "$@"; ZONE=$2; shift 2 ;;
    --config) takes "$@"; CONFIG=$2; shift 2 ;;
    --dir) takes "$@"; DIR=$2; shift 2 ;;
    --log-dir) takes "$@"; LOGS=$2; shift 2 ;;
    --collect) takes "$@"; COLLECT=$2; shift 2 ;;
    --background) BACKGROUND=1; shift ;;
    --project) takes "$@"; PROJECT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
need name "$NAME"; need zone "$ZONE"; need config "$CONFIG"
require_gcloud
quoted=""
for item in "${OVERRIDES[@]}"; do quoted+=" $(printf '%q' "$item")"; done
worker='$(hostname | sed -E "s/.*-w-([0-9]+)$/\1/")'
train="cd $DIR && mkdir -p $LOGS && python3 -m jppo.train --config $CONFIG --distributed auto$quoted > $LOGS/worker-$worker.log 2>&1"
if [[ "$BACKGROUND" == 1 ]]; then
  train="nohup bash -c '$train' > /dev/null 2>&1 &"
fi
ssh_all "$NAME" "$ZONE" "$PROJECT" "$train"
if [[ -n "$COLLECT" ]]; then
  extra=()
  [[ -n "$PROJECT" ]] && extra+=(--project "$PROJECT")
  run mkdir -p "$COLLECT"
  run gcloud compute tpus tpu-vm scp "$NAME:$LOGS/*.log" "$COLLECT/" --zone "$ZONE" "${extra[@]}" --worker=all
fi
