"""Test session set-up: 8 simulated CPU devices and a persistent compile cache, before any JAX operation."""

import os
import pathlib

import jax

jax.config.update("jax_num_cpu_devices", 8)
_CACHE = pathlib.Path(os.environ.get("JAX_COMPILATION_CACHE_DIR", pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
