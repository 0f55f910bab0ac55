"""The simulator's cost models: reproducible jagged variants, 2-D per-request-count tables, and the step model's
parts."""

import numpy as np
import pytest

from benchmarks.dspark_research.cost_models import CostTable2D, StepCostModel, knee_cost_table
from deepinfer_plugins.dspark.cost_model import CostTable


def test_knee_tables():
    flat = knee_cost_table(20.0, 64)
    assert flat(1) == flat(64) == 20.0 and flat(128) == pytest.approx(40.0)
    assert flat(65) == pytest.approx(20.0 * 72 / 64)  # padded to the 72-token graph
    soft = knee_cost_table(20.0, 64, shape="soft")
    assert soft(64) == pytest.approx(20.0 * np.sqrt(2))
    j1, j2 = knee_cost_table(20.0, 64, jitter=0.1, seed=3), knee_cost_table(20.0, 64, jitter=0.1, seed=3)
    b = np.arange(1, 600)
    assert (j1.costs(b) == j2.costs(b)).all() and (np.diff(j1.costs(b)) >= 0).all()
    assert not np.allclose(j1.costs(b), flat.costs(b))
    with pytest.raises(ValueError):
        knee_cost_table(20.0, 64, shape="cubic")


def test_2d_table_and_step_model():
    small, big = CostTable([8, 16], [1.0, 2.0]), CostTable([8, 16], [3.0, 4.0])
    t2 = CostTable2D([4, 16], [small, big])
    assert t2.at_requests(3) is small and t2.at_requests(5) is big and t2.at_requests(99) is big
    m = StepCostModel(t2, gamma=5, draft_floor_ms=0.5, draft_ms_per_token=0.1, overhead_ms=1.0,
                      overhead_ms_per_token=0.01)
    assert m.for_scheduler(2)(9) == pytest.approx(2.0 + 0.5 + 0.1 * 10 + 1.0)
    assert m.step_ms(2, 9, 100) == pytest.approx(4.5 + 1.0)
    with pytest.raises(TypeError):
        StepCostModel("table", gamma=5)
