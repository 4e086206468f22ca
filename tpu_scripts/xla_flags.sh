# The XLA / libtpu flags jppo's launch scripts start a run with: the one place they are written. Sourced, not
# executed (by launch.sh on every TPU worker, by gpu_slurm.sbatch on every node; by hand: `source
# tpu_scripts/xla_flags.sh` before `python -m jppo.train`). The run's first log lines show what it saw
# (jppo.cli.start logs XLA_FLAGS, LIBTPU_INIT_ARGS and XLA_PYTHON_CLIENT_MEM_FRACTION).
#
# A flag already in XLA_FLAGS / LIBTPU_INIT_ARGS keeps the user's value (only absent flags are added);
# JPPO_XLA_FLAGS=off adds nothing; JPPO_BACKEND=gpu|tpu|cpu overrides the detection (an NVIDIA driver: gpu; a TPU
# chip's /dev/accel* or /dev/vfio: tpu; else cpu, where nothing is added).
#
# GPU (XLA's GPU flags; every name below is in jaxlib 0.10.2's flag table, libjax_common.so): the latency-hiding
# scheduler overlaps collectives with compute, and the pipelined all-gather / reduce-scatter / all-reduce move the
# FSDP weight gathers and gradient reductions of the next/previous layer of the scanned layer loop under this
# layer's compute. XLA_PYTHON_CLIENT_MEM_FRACTION: JAX preallocates 75% of a GPU's memory by default; jppo's
# memory plan (python -m jppo.plan) counts against what the allocator takes, so the fraction is set here once.
#
# TPU (libtpu's flags, MaxText's set for asynchronous collectives; every name below is in libtpu.so of libtpu
# 0.0.42.1 and 0.0.48.1, the versions jax 0.10.2's and jax 0.11.2's `tpu` extras pin, and of 0.0.52; a libtpu that
# does not know a flag refuses to start, naming it):
# collective fusion runs all-gathers and reduce-scatters asynchronously beside the compute that does not depend on
# them, over several steps of the layer loop.

_jppo_backend() {
  if [[ -n "${JPPO_BACKEND:-}" ]]; then
    echo "$JPPO_BACKEND"
  elif command -v nvidia-smi >/dev/null 2>&1 || [[ -e /dev/nvidiactl ]]; then
    echo gpu
  elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    echo tpu
  else
    echo cpu
  fi
}

# _jppo_add VARIABLE FLAG...: append each --name=value whose --name is not in $VARIABLE yet.
_jppo_add() {
  local variable=$1 flag
  shift
  for flag in "$@"; do
    if [[ " ${!variable:-} " != *" ${flag%%=*}="* ]]; then
      printf -v "$variable" '%s' "${!variable:+${!variable} }$flag"
    fi
  done
  export "${variable?}"
}

JPPO_GPU_XLA_FLAGS=(
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  --xla_gpu_enable_highest_priority_async_stream=true
)
JPPO_TPU_LIBTPU_FLAGS=(
  --xla_tpu_enable_async_collective_fusion=true
  --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true
  --xla_tpu_enable_async_collective_fusion_multiple_steps=true
  --xla_tpu_overlap_compute_collective_tc=true
  --xla_enable_async_all_gather=true
)

if [[ "${JPPO_XLA_FLAGS:-on}" != off ]]; then
  case "$(_jppo_backend)" in
    gpu)
      _jppo_add XLA_FLAGS "${JPPO_GPU_XLA_FLAGS[@]}"
      export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
      ;;
    tpu)
      _jppo_add LIBTPU_INIT_ARGS "${JPPO_TPU_LIBTPU_FLAGS[@]}"
      ;;
  esac
fi
