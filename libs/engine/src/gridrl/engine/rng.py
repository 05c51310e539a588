"""Per-sequence random numbers that do not depend on what else is in the batch.

A sequence's sampler is a counter-based stream: the uniform that draws its token ``t`` is
``splitmix64(seed + (t + 1) * golden) / 2**64`` (Steele, Lea & Flood 2014, "Fast splittable
pseudorandom number generators"), i.e. the t-th output of a splitmix64 generator started at
``seed``. It is a pure function of (sequence seed, step), so the same sequence draws the same
uniforms whatever batch it is decoded in and whichever device runs it, and a whole batch's
uniforms for one step are one vectorized numpy expression.

The engine gives sample ``i`` of a request seeded ``s`` the seed :func:`sequence_seed` ``(s, i)``.
"""

from __future__ import annotations

import secrets

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_INDEX_MIX = 0xD1B54A32D192ED03


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def sequence_seed(request_seed: int, index: int) -> int:
    """Seed of sample ``index`` (0-based) of a request seeded ``request_seed``.

    Returns an int in [0, 2**64). Distinct indices give unrelated streams; the result depends
    only on the two arguments (never on batch composition).
    """
    return _mix64(_mix64(request_seed + _GOLDEN) + (index + 1) * _INDEX_MIX)


def random_seed() -> int:
    """A fresh seed for a request that did not set one, in [0, 2**63)."""
    return secrets.randbits(63)


def step_uniforms(seeds: np.ndarray, step: int) -> np.ndarray:
    """The uniforms that draw token ``step`` of each sequence.

    Args:
        seeds: uint64 array (N,), the sequences' seeds.
        step: 0-based index of the token being drawn.
    Returns:
        float64 array (N,) in [0, 1) (53-bit resolution).
    """
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + np.uint64(((step + 1) * _GOLDEN) & MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def seeds_array(seeds: list[int]) -> np.ndarray:
    """Python int seeds (any size) -> uint64 array (reduced mod 2**64)."""
    return np.array([s & MASK64 for s in seeds], dtype=np.uint64)
