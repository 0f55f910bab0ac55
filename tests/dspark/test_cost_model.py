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
