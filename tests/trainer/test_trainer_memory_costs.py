"""The activation cost's arithmetic shared by the torch and MLX memory bounds
(:mod:`gridrl.trainer.backends.memory`), without a model: the probes' shapes, the cost from
their peaks, the widths measured, the optimizer's reserve."""

from __future__ import annotations

import pytest

from gridrl.trainer.backends.memory import (
    WIDTH_STEP,
    ActivationCost,
    CostsByWidth,
    adamw_reserve_bytes,
    cost_from_probes,
    probe_shapes,
)


def _quadratic(fixed: float, a: float, b: float):
    """A peak ``fixed + n * (a * w + b * w**2)``: per-token activations and attention's
    scores."""
    return lambda n, w: fixed + n * (a * w + b * w * w)


def _cost(peak, width: int) -> ActivationCost:
    return cost_from_probes(width, *(peak(n, w) for n, w in probe_shapes(width)))


@pytest.mark.parametrize("width", [2, 3, 96, 127, 128, 192])
def test_no_probe_holds_more_than_one_sequence_of_the_width(width):
    shapes = probe_shapes(width)
    assert len(shapes) == 3
    assert all(n * w <= width for n, w in shapes)
    assert max(w for _, w in shapes) == width
    assert [n for n, _ in shapes] == [1, 2, 1]


def test_the_probes_of_192_tokens():
    assert probe_shapes(192) == [(1, 96), (2, 96), (1, 192)]


def test_a_linear_peak_is_recovered_exactly():
    cost = _cost(_quadratic(5000.0, 40.0, 0.0), 128)
    assert cost == ActivationCost(fixed=5000.0, per_token=40.0, probe_width=128)


@pytest.mark.parametrize("width", [64, 128, 192, 257])
@pytest.mark.parametrize("fixed,a,b", [(5000.0, 40.0, 0.5), (0.0, 1.0, 3.0),
                                       (1e6, 0.0, 2.0), (300.0, 10.0, 0.0)])
def test_the_cost_bounds_every_micro_batch_up_to_the_width_from_above(width, fixed, a, b):
    """Every n sequences w tokens wide (w up to the width and half again), one-sequence and
    narrow ones included, costs no more than the cost says; each probe's peak is met."""
    peak = _quadratic(fixed, a, b)
    cost = _cost(peak, width)
    for n, w in probe_shapes(width):
        assert cost.fixed + cost.per_token * n * w >= peak(n, w) - 1e-6 * peak(n, w)
    half = width // 2
    for n in (1, 2, 3, 8, 64):
        for w in (1, 2, half // 2, half, width - 1, width, width + half):
            if w < 1:
                continue
            bound = cost.fixed + cost.per_token * n * w
            assert bound >= peak(n, w) * (1 - 1e-12), (n, w, bound, peak(n, w))


def test_a_narrow_sequence_is_not_under_counted_by_a_wide_measurement():
    """With attention's quadratic part, the fixed part is what does not grow with the
    sequences (``2 * short - two``), not what the wide probe leaves above its tokens (which
    is lower by ``b * width * width / 2`` and would under-count one narrow sequence)."""
    peak = _quadratic(1000.0, 10.0, 4.0)
    cost = _cost(peak, 128)
    assert cost.fixed == pytest.approx(1000.0)
    assert cost.per_token == pytest.approx(10.0 + 4.0 * (128 + 64))
    assert cost.fixed + cost.per_token * 1 >= peak(1, 1)


def test_noise_never_makes_the_cost_negative_or_below_a_probe():
    shapes = probe_shapes(128)
    for peaks in ([100.0, 90.0, 80.0], [0.0, 0.0, 0.0], [50.0, 300.0, 60.0],
                  [500.0, 600.0, 400.0]):
        cost = cost_from_probes(128, *peaks)
        assert cost.fixed >= 0 and cost.per_token >= 0
        for (n, w), p in zip(shapes, peaks, strict=True):
            assert cost.fixed + cost.per_token * n * w >= p - 1e-9


def test_widths_are_measured_rounded_up_and_reused_by_narrower_steps():
    measured: list[int] = []

    def measure(width: int) -> ActivationCost:
        measured.append(width)
        return ActivationCost(fixed=float(width), per_token=1.0, probe_width=width)

    costs = CostsByWidth(measure, floor=128)
    assert costs(40).probe_width == 128  # never below the start-up probe's width
    assert costs(128).probe_width == 128
    assert costs(174).probe_width == 192  # 174 rounded up to WIDTH_STEP
    assert 192 % WIDTH_STEP == 0
    assert costs(150).probe_width == 192  # narrower: the widest measurement serves
    assert costs(192).probe_width == 192
    assert costs(193).probe_width == 224
    assert costs(100).probe_width == 224
    assert measured == [128, 192, 224]


def test_width_to_measure():
    assert CostsByWidth.width_to_measure(174, 0, 128) == 192
    assert CostsByWidth.width_to_measure(174, 256, 128) is None
    assert CostsByWidth.width_to_measure(100, 0, 128) == 128
    assert CostsByWidth.width_to_measure(257, 256, 128) == 288


def test_the_optimizer_reserve_counts_moments_temporaries_and_gradient_copies():
    assert adamw_reserve_bytes(1000, moments_pending=True) == 3000  # torch before step 1
    assert adamw_reserve_bytes(1000, moments_pending=False) == 1000
    assert adamw_reserve_bytes(1000, moments_pending=True, gradient_copies=2) == 5000  # MLX
    assert adamw_reserve_bytes(1000, moments_pending=False, gradient_copies=2) == 3000
    assert adamw_reserve_bytes(0, moments_pending=True, gradient_copies=2) == 0
