"""DSpark scheduling research on the CPU: the closed-loop simulator, its synthetic acceptance and cost curves,
and the verify-length policies it compares (benchmarks/dspark_sim.py runs them).

Kept out of deepinfer_plugins because no engine runs any of it; what engines do run (Algorithm A, the measured
cost table, calibration, verification) stays in deepinfer_plugins/dspark and is imported from there.
"""
