#!/usr/bin/env bash
# The device check: what jppo does on the accelerator of this machine, in time-boxed stages that each write one JSON
# file to $OUT (default runs/device_check), with no network and the image's own jax.
#
#   bash bench/device_check.sh          # on one GPU (or TPU host): under 9 minutes
#   bash bench/device_check.sh --cpu    # or DEVICE_CHECK_CPU=1: tiny shapes, seconds per stage (CI's rehearsal)
#
# Stages, in order (each `timeout`-boxed; a stage that fails or runs out of time still leaves OUT/STAGE.json with
# "status": "error" or "timeout", and the next stage runs):
#   versions       versions, devices, XLA environment, bf16 matmul TFLOP/s
#   attention      every jppo.models.config.ATTENTION_IMPLEMENTATIONS: forward+backward time, error vs reference,
#                  at (B=1, T=4096) and (B=2, T=1024)
#   quickstart     5 steps of configs/quickstart.yaml
#   grpo_step      one GRPO step of a Qwen2.5-0.5B-shaped random model: phases, tokens/s, device peak vs jppo.plan
#   accelerator    python -m bench.run --only accelerator (MFU, decode roofline; needs no torch)
#   decode_blocks  decoding with 8 response-cache blocks vs 1
# OUT/summary.json lists every stage's status and seconds.
#
# Python packages: the image's jax stays as it is (no second jax is installed). jppo's other dependencies that the
# image lacks come from a folder of wheels, $DEVICE_CHECK_WHEELS (default bench/device_check/wheels, ignored by
# git: make it on a machine with the registry with `bash bench/device_check/wheels.sh`, and carry it to the device
# machine with the working tree): `pip install --no-index --find-links` installs from it only what is missing.
# Without the folder the packages must already be there. jppo itself runs from this checkout (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."

CPU=${DEVICE_CHECK_CPU:-0}
[[ "${1:-}" == --cpu ]] && CPU=1
OUT=${OUT:-runs/device_check}
PYTHON=${PYTHON:-python3}
WHEELS=${DEVICE_CHECK_WHEELS:-bench/device_check/wheels}
# Seconds for the whole check (DEVICE_CHECK_BUDGET), and each stage's own box; in CPU mode the boxes are shares of
# the budget (CI's smoke test gives it 60 s, where the training stages may run out of time on 2 loaded cores).
if [[ "$CPU" == 1 ]]; then
  BUDGET=${DEVICE_CHECK_BUDGET:-60}
  declare -A LIMIT=([versions]=14 [attention]=12 [quickstart]=9 [grpo_step]=9 [accelerator]=6 [decode_blocks]=10)
else
  BUDGET=${DEVICE_CHECK_BUDGET:-530}
  declare -A LIMIT=([versions]=45 [attention]=75 [quickstart]=75 [grpo_step]=120 [accelerator]=135 [decode_blocks]=75)
fi
STAGES=(versions attention quickstart grpo_step accelerator decode_blocks)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEVICE_CHECK_WORK=${DEVICE_CHECK_WORK:-${TMPDIR:-/tmp}/jppo-device-check}
if [[ "$CPU" == 1 ]]; then
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
  # compile in about half the time (the same programs, only slower: CI's numbers mean nothing)
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
else
  source tpu_scripts/xla_flags.sh  # the flags of every jppo launch (logged by the versions stage)
fi
started=$SECONDS

if [[ -d "$WHEELS" ]]; then
  missing=$("$PYTHON" - <<'EOF'
import importlib.util, re, sys, tomllib
# jppo's dependencies for this Python that do not import, by import name where it is not the distribution's
modules = {"pyyaml": "yaml", "orbax-checkpoint": "orbax.checkpoint", "tensorboardx": "tensorboardX"}
here = repr(f"{sys.version_info[0]}.{sys.version_info[1]}")
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    spec, _, marker = requirement.partition(";")
    if marker and not eval(marker.replace("python_version", here)):  # pyproject's own markers
        continue
    name = re.split(r"[\[<>=!~ ]", spec.strip())[0]
    try:
        found = importlib.util.find_spec(modules.get(name.lower(), name.replace("-", "_"))) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        print(spec.strip())
EOF
)
  if [[ -n "$missing" ]]; then
    # the requirements the folder has a wheel of, in one pip call (a package it leaves out, matplotlib, would fail it)
    present=()
    for requirement in $missing; do
      name=$(echo "${requirement%%[[<>=!~]*}" | tr 'A-Z.-' 'a-z__')
      if ls "$WHEELS" | sed 's/-.*//' | tr 'A-Z.' 'a-z_' | grep -qx "$name"; then
        present+=("$requirement")
      else
        echo "device_check: warning: $requirement is missing and not in $WHEELS" >&2
      fi
    done
    echo "device_check: installing from $WHEELS: ${present[*]}" >&2
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" "${present[@]}" > "$OUT/pip.log" 2>&1 \
      || echo "device_check: warning: pip could not install them (see $OUT/pip.log)" >&2
  fi
fi

cpu_flag=()
[[ "$CPU" == 1 ]] && cpu_flag=(--cpu)
declare -A COMMAND=(
  [versions]="-m bench.device_check.stages versions"
  [attention]="-m bench.device_check.stages attention"
  [quickstart]="-m bench.device_check.runs quickstart"
  [grpo_step]="-m bench.device_check.runs grpo_step"
  [decode_blocks]="-m bench.device_check.stages decode_blocks"
)
summary="{"
for stage in "${STAGES[@]}"; do
  left=$((BUDGET - (SECONDS - started)))
  limit=${LIMIT[$stage]}
  [[ "$CPU" == 1 ]] && limit=$((limit * BUDGET / 60))  # CPU mode's boxes are shares of its budget
  ((limit > left)) && limit=$left
  ((limit < 0)) && limit=0
  begin=$SECONDS
  if ((limit < 1)); then
    status=124
  elif [[ "$stage" == accelerator ]]; then
    mode=(--accelerator full)
    [[ "$CPU" == 1 ]] && mode=(--accelerator stand-in --quick --repeats 1)
    timeout --kill-after=5 "$limit" "$PYTHON" -m bench.run --only accelerator "${mode[@]}" --out "$OUT/accelerator_run" \
      > "$OUT/$stage.log" 2>&1
    status=$?
    if [[ "$status" == 0 ]]; then
      "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1])); json.dump({"stage": "accelerator", "status": "ok", "mfu": r.get("accelerator_mfu"), "decode_vs_roofline": r.get("accelerator_decode_vs_roofline"), "results": r}, open(sys.argv[2], "w"), indent=2)' \
        "$OUT/accelerator_run/results.json" "$OUT/accelerator.json" || status=1
    fi
  else
    # shellcheck disable=SC2086
    timeout --kill-after=5 "$limit" "$PYTHON" ${COMMAND[$stage]} --out "$OUT" "${cpu_flag[@]}" > "$OUT/$stage.log" 2>&1
    status=$?
  fi
  seconds=$((SECONDS - begin))
  if [[ "$status" == 124 || "$status" == 137 ]]; then
    word=timeout
  elif [[ "$status" == 0 ]]; then
    word=ok
  else
    word=error
  fi
  # a stage that died without its own JSON (killed, or failed before writing) gets one here
  if [[ "$word" != ok ]] && ! "$PYTHON" -c 'import json, sys; assert json.load(open(sys.argv[1]))["status"] == "error"' \
      "$OUT/$stage.json" 2>/dev/null; then
    printf '{"stage": "%s", "status": "%s", "exit_status": %d, "limit_s": %d, "log_tail": %s}\n' "$stage" "$word" \
      "$status" "$limit" "$(tail -c 3000 "$OUT/$stage.log" 2>/dev/null | "$PYTHON" -c 'import json, sys; print(json.dumps(sys.stdin.read()))')" \
      > "$OUT/$stage.json"
  fi
  echo "device_check: $stage: $word in ${seconds}s (limit ${limit}s)" >&2
  summary+="\"$stage\": {\"status\": \"$word\", \"seconds\": $seconds, \"limit_s\": $limit}, "
done
summary+="\"cpu_mode\": $([[ "$CPU" == 1 ]] && echo true || echo false), \"total_s\": $((SECONDS - started))}"
echo "$summary" > "$OUT/summary.json"
rm -rf "$DEVICE_CHECK_WORK"  # models, prompts and runs: GBs on a GPU
echo "device_check: wrote $OUT (total $((SECONDS - started))s)" >&2
