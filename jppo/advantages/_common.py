"""Small shared pieces of the advantage estimators: input checks and NaN-safe numerics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def check_token_arrays(mask: Array, **arrays: Array) -> None:
    """Raises ``ValueError`` unless ``mask`` is ``[batch, length]`` and every named array has its shape."""
    if mask.ndim != 2:
        raise ValueError(f"mask must be [batch, length]; got shape {tuple(mask.shape)}")
    for name, array in arrays.items():
        if array.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}; got {tuple(array.shape)}")


def check_row_arrays(mask: Array, **arrays: Array) -> None:
    """Raises ``ValueError`` unless every named array is ``[batch]`` for the ``[batch, length]`` mask."""
    for name, array in arrays.items():
        if array.shape != mask.shape[:1]:
            raise ValueError(f"{name} must be [batch] = {tuple(mask.shape[:1])}; got {tuple(array.shape)}")


def float_dtype(array: Array) -> jnp.dtype:
    """``array``'s dtype if it is floating, else the default float dtype (float64 under x64)."""
    return array.dtype if jnp.issubdtype(array.dtype, jnp.floating) else jnp.result_type(float)


def sanitize(values: Array, valid: Array) -> Array:
    """``values`` where ``valid``, 0 elsewhere: NaN/Inf at masked positions reach neither results nor gradients."""
    return jnp.where(valid, values, 0)


def safe_sqrt(values: Array) -> Array:
    """``sqrt`` of non-negative ``values`` with a finite (zero) gradient at 0, where ``sqrt``'s is infinite."""
    positive = values > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, values, 1)), 0)
