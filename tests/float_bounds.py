"""Float comparisons between two code paths, at bounds derived from float32 rounding.

Two paths that compute the same quantity in float32 (another summation order, batch layout,
kernel, process layout or framework) agree to a rounding error that scales with the size of
what they sum; the order itself changes with the CPU (AVX2, AVX-512 and AMX kernels block
their sums differently) and with the thread count. So a test compares what its claim is about
(a loss, a gradient, logprobs) at a bound in units of float32's epsilon times the scale of that
quantity, and never the weights after an optimizer step at a fixed tolerance: Adam's first step
moves each entry by ``lr * g / (|g| + eps)``, about ``lr * sign(g)``, so an entry whose gradient
is within rounding of zero moves by ``+lr`` or ``-lr`` depending on the CPU.

Tests import it as ``from float_bounds import ...`` (``tests/`` is on ``sys.path`` through its
``conftest.py``). With ``GRIDRL_FLOAT_MARGINS=FILE`` in the environment every check appends a
tab-separated line (test, what, error, bound) to FILE: how to read the margins on a new CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

EPS32 = 2.0 ** -23  # float32 machine epsilon (the spacing of float32 numbers at 1), ~1.19e-7

# A quantity computed through the tiny llama (a logprob, a loss's LoRA gradient) accumulates the
# rounding of a chain of about a dozen products, each a sum of <= 128 terms that adds about
# sqrt(128) * eps/2 relative to the size of those terms: 12 * 11 * eps/2 ~ 66 eps, relative to
# the largest entry of what is compared (an entry near zero is a sum of terms as large as the
# largest entry's). 1e-5 is 84 eps.
ROUNDING_REL = 1e-5


def as_float64(x: Any) -> np.ndarray:
    """A torch tensor, numpy array, MLX array or sequence of floats as a float64 numpy array."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def max_abs(x: Any) -> float:
    """Largest absolute entry (0 for an empty input)."""
    a = as_float64(x)
    return float(np.abs(a).max()) if a.size else 0.0


def max_error(got: Any, want: Any) -> float:
    """``max |got - want|`` over entries of equal shapes."""
    a, b = as_float64(got), as_float64(want)
    assert a.shape == b.shape, (a.shape, b.shape)
    return max_abs(a - b)


def assert_within(error: float, bound: float, what: str) -> None:
    """Assert ``error <= bound`` and record the margin (``GRIDRL_FLOAT_MARGINS``)."""
    path = os.environ.get("GRIDRL_FLOAT_MARGINS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{what}\t{error:.3e}\t{bound:.3e}\n")
    assert error <= bound, f"{what}: error {error:.3g} > bound {bound:.3g} ({error / bound:.3g}x)"


def assert_close_to_largest(got: Any, want: Any, rel: float, what: str) -> None:
    """``max |got - want| <= rel * max |want|``: one tensor computed by two paths whose
    rounding is relative to the tensor's largest entry (its entries are sums of terms of that
    size, so an entry near zero carries the same absolute rounding as the largest)."""
    assert_within(max_error(got, want), rel * max_abs(want), what)


def assert_tensors_close_to_largest(got: Iterable[Any], want: Iterable[Any], rel: float,
                                    what: str) -> None:
    """:func:`assert_close_to_largest` for each pair of two equally long sequences (e.g. the
    gradients of each LoRA tensor, each at the scale of its own largest entry)."""
    got, want = list(got), list(want)
    assert len(got) == len(want) > 0, (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close_to_largest(g, w, rel, f"{what}[{i}]")


def largest_relative_difference(got: Iterable[Any], want: Iterable[Any]) -> float:
    """``max_i max |got_i - want_i| / max |want_i|``: how far apart two sequences of tensors
    are, in units of each tensor's largest entry (to show a contrast is O(1), far above
    rounding)."""
    return max(max_error(g, w) / max(max_abs(w), np.finfo(np.float64).tiny)
               for g, w in zip(got, want, strict=True))
