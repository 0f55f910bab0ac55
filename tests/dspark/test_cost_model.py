"""Cost tables: ceiling-bucket lookup up to the capture limit, linear above, monotone in B."""

import numpy as np
import pytest

from deepinfer_plugins.dspark.cost_model import CostTable


def test_ceiling_bucket_then_linear():
    t = CostTable([1, 4, 8, 16], [1.0, 2.0, 3.0, 5.0], capture_limit=8)
    assert t.costs(np.array([1, 2, 4, 5, 8])).tolist() == [1.0, 2.0, 2.0, 3.0, 3.0]
    assert t(12) == pytest.approx(4.0)  # interpolated between 8 and 16 (eager)
    assert t(24) == pytest.approx(7.0)  # extrapolated with the last slope


def test_monotone_and_validation():
    t = CostTable([1, 2, 3], [2.0, 1.0, 3.0])
    assert t.costs(np.array([1, 2, 3])).tolist() == [2.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        CostTable([2, 1], [1.0, 1.0])
    with pytest.raises(ValueError):
        CostTable([1, 2], [1.0, -1.0])
    with pytest.raises(TypeError):
        CostTable([1.5, 2.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        t(0)


def test_measured_table_times_each_size_over_the_same_context(tiny256, monkeypatch):
    """measure_step_cost (behind ``deepinfer measure-step-cost``): every size is timed repeats + 1 times (one
    warm-up), each forward runs B new tokens over the same cached context (the cache is rolled back after each), and
    the median of the timed runs is the table's entry."""
    from deepinfer_plugins.dspark.cost_model import measure_step_cost

    calls, forward = [], type(tiny256).forward

    def recorded(self, input_ids, cache=None, *args, **kwargs):
        calls.append((input_ids.shape[0], cache.num_tokens))
        return forward(self, input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(type(tiny256), "forward", recorded)
    durations_ms = [100, 2, 4, 100, 6, 10]  # per run: size 1 (warm-up, 2 timed), then size 3
    reads = [t for k, d in enumerate(durations_ms) for t in (float(k), k + d / 1e3)]  # start, end of each run
    table = measure_step_cost(tiny256, [1, 3], context=10, repeats=2, clock=iter(reads).__next__)
    assert calls == [(10, 0)] + [(1, 10)] * 3 + [(3, 10)] * 3
    assert table.sizes.tolist() == [1, 3] and table.ms.tolist() == pytest.approx([3.0, 8.0])  # warm-ups dropped
    with pytest.raises(ValueError):
        measure_step_cost(tiny256, [0, 2])
