"""``python -m jppo.serve [--host H] [--port P]``: a vLLM rollout server (:mod:`jppo.rollout.vllm_server`) that runs
point at with ``rollout.vllm.servers: [H:P]``; runs start their own with ``rollout.vllm.num_servers``. On a GPU node
give it GPUs of its own (``CUDA_VISIBLE_DEVICES=7 python -m jppo.serve ...``) and the trainer the others."""

from __future__ import annotations

import os
import sys

# the server never computes with JAX (imported with jppo's packages): it must not take an accelerator's memory
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jppo.rollout.vllm_server import main, parse_args  # noqa: E402, F401 (parse_args: tests/test_docs.py)

if __name__ == "__main__":
    sys.exit(main())
