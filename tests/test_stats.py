"""Known answers for the confidence intervals the report prints."""

from __future__ import annotations

import math

import pytest

from fedmech_flwr.tools.report.stats import mean_ci


@pytest.mark.parametrize(("values", "t_quantile"), [
    ([0.0, 2.0], 12.706204736),  # df=1, standard error 1
    ([1 - math.sqrt(3), 1.0, 1 + math.sqrt(3)], 4.302652730),  # df=2, standard error 1
    ([1 + math.sqrt(10), 1 - math.sqrt(10), 1.0, 1.0, 1.0], 2.776445105),  # df=4, standard error 1
])
def test_the_half_width_is_the_t_quantile_times_the_standard_error(values, t_quantile):
    mean, half_width, n = mean_ci(values)
    assert mean == pytest.approx(1.0)
    assert half_width == pytest.approx(t_quantile, abs=1e-8)
    assert n == len(values)


def test_a_hand_computed_interval():
    # mean 82, sample sd 2 (squares 4 + 0 + 4 over df 2), se 2 / sqrt(3); t_{0.975, 2} = 4.302652730
    mean, half_width, n = mean_ci([80.0, 82.0, 84.0])
    assert (mean, n) == (pytest.approx(82.0), 3)
    assert half_width == pytest.approx(4.302652730 * 2 / math.sqrt(3), abs=1e-8)
    # 90%: t_{0.95, 2} = 2.919985580
    assert mean_ci([80.0, 82.0, 84.0], confidence=0.90)[1] == pytest.approx(2.919985580 * 2 / math.sqrt(3), abs=1e-8)


def test_one_value_has_no_interval_and_none_is_an_error():
    assert mean_ci([0.7]) == (0.7, None, 1)
    with pytest.raises(ValueError, match="at least one"):
        mean_ci([])
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1.0, 2.0], confidence=95)
