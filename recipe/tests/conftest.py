import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def pytest_terminal_summary(terminalreporter):
    """Shows how many boundary and prompt-shape cases of each class the differential suite
    compared, so a run's log says what was covered and not only that it passed."""
    gen = sys.modules.get("gen")
    for attr, title in (("STATS", "boundary cases"), ("SHAPE_STATS", "prompt-shape cases")):
        stats = getattr(gen, attr, None)
        if not stats:
            continue
        terminalreporter.write_sep("-", f"{title} compared with the official package")
        for (api, kind), n in sorted(stats.items()):
            terminalreporter.write_line(f"{api:9} {kind:20} {n:4}")
        terminalreporter.write_line(f"{'total':30} {sum(stats.values()):4}")
