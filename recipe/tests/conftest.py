import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def pytest_terminal_summary(terminalreporter):
    """Shows how many boundary cases of each class the differential suite compared, so a run's
    log says what was covered and not only that it passed."""
    gen = sys.modules.get("gen")
    stats = getattr(gen, "STATS", None)
    if not stats:
        return
    terminalreporter.write_sep("-", "boundary cases compared with the official package")
    for (api, kind), n in sorted(stats.items()):
        terminalreporter.write_line(f"{api:9} {kind:18} {n:4}")
    terminalreporter.write_line(f"{'total':28} {sum(stats.values()):4}")
