"""Statistics over the valid (mask = 1) positions of an array; values at masked positions are never read.

With ``m`` the mask, ``x`` the values and ``N = sum m``:

- ``masked_mean = sum m x / N`` (0 when ``N = 0``);
- ``masked_var = sum m (x - mean)^2 / (N - 1)`` (unbiased) or ``/ N`` (biased); 0 when the divisor is not positive;
- ``masked_whiten = (x - mean) / sqrt(var_unbiased + epsilon)`` on valid positions, 0 on masked ones.

verl divides the mean by ``N + 1e-8`` and raises for ``N <= 1``; jppo divides exactly and returns 0 instead, so
the functions stay jittable. Both keep ``epsilon = 1e-8`` in the whitening, which keeps rounding noise from being
blown up when all valid values are (nearly) equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jppo.advantages._common import float_dtype, sanitize
from jppo.losses.aggregate import masked_sum, safe_divide

Array = jax.Array


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Mean of ``x`` over positions where ``mask`` is set, reduced over ``axis`` (all axes by default).

    ``sum m x / sum m``; exactly 0 (with a zero gradient) where no position is valid.
    """
    count = jnp.sum(mask.astype(bool), axis=axis, dtype=float_dtype(x))
    return safe_divide(masked_sum(x, mask, axis=axis), count)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance of the valid entries of ``x`` (all axes).

    ``sum m (x - mean)^2 / (N - 1)`` with Bessel's correction (``unbiased=True``), else ``/ N``. Returns 0 when
    there are too few valid entries for the divisor to be positive (verl raises there).
    """
    valid = mask.astype(bool)
    dtype = float_dtype(x)
    count = jnp.sum(valid, dtype=dtype)
    squared_deviation = jnp.square(sanitize(x - masked_mean(x, valid), valid))
    divisor = jnp.maximum(count - 1, 0) if unbiased else count
    return safe_divide(jnp.sum(squared_deviation), divisor)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, epsilon: float = 1e-8) -> Array:
    """Standardizes ``x`` with the mean and unbiased variance of its valid entries.

    ``(x - mean) / sqrt(var + epsilon)`` at valid positions (``mean`` added back when ``shift_mean`` is False),
    exactly 0 at masked ones (verl returns the formula's value there too).
    """
    valid = mask.astype(bool)
    mean = masked_mean(x, valid)
    whitened = sanitize(x - mean, valid) * jax.lax.rsqrt(masked_var(x, valid) + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return sanitize(whitened, valid)
