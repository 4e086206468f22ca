# Shared helpers of the TPU scripts: argument parsing, --dry-run, and one place that runs gcloud.
# Sourced, not executed.

set -euo pipefail

DRY_RUN=0
# Where setup.sh makes the workers' Python environment (uv; the TPU VM image's own python3 is 3.10, below jppo's
# floor) and launch.sh runs from; written unexpanded, so each worker expands ~ itself.
DEFAULT_VENV='~/jppo-venv'

die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

# run CMD...: print the command; execute it unless --dry-run.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [[ "$DRY_RUN" == 0 ]]; then
    "$@"
  fi
}

require_gcloud() {
  if [[ "$DRY_RUN" == 0 ]] && ! command -v gcloud >/dev/null 2>&1; then
    die "gcloud is not installed or not on PATH (install the Google Cloud CLI, or use --dry-run to see the commands)"
  fi
}

# takes OPTION [NEXT ...]: fail unless OPTION is followed by its value; an option in its place (`--collect
# --dry-run`) would be swallowed as the value, and the command run for real.
takes() {
  if [[ $# -lt 2 || "$2" == --* ]]; then
    die "$1 needs a value (see --help)"
  fi
}

# need NAME VALUE: fail with a clear message when a required option is missing.
need() {
  if [[ -z "$2" ]]; then
    die "missing --$1 (see --help)"
  fi
}

# ssh_all NAME ZONE PROJECT COMMAND: run COMMAND on every worker of the TPU VM.
ssh_all() {
  local name=$1 zone=$2 project=$3 command=$4
  local extra=()
  [[ -n "$project" ]] && extra+=(--project "$project")
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${extra[@]}" --worker=all --command "$command"
}

# follow_log NAME ZONE PROJECT LOG_DIR WORKER: print one worker's log as it grows (tail -F over ssh). Stopping it
# (Ctrl-C, a dropped connection) stops the following only: launch.sh starts the run detached from the ssh session.
follow_log() {
  local name=$1 zone=$2 project=$3 logs=$4 worker=$5
  local extra=()
  [[ -n "$project" ]] && extra+=(--project "$project")
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${extra[@]}" --worker="$worker" \
    --command "tail -n +1 -F $logs/worker-$worker.log"
}

# common_option ARGS...: the options every script takes (--project, --dry-run, --help), else an unknown argument;
# sets SHIFT_BY to the words it took.
common_option() {
  case "$1" in
    --project) takes "$@"; PROJECT=$2; SHIFT_BY=2 ;;
    --dry-run) DRY_RUN=1; SHIFT_BY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
}
