"""Measured test durations (tests/durations.json), and the quick pass they define.

`make test-quick` runs the tests marked neither `slow` nor `gpu`: a test is slow when its module launches
jobs, processes, nodes, Spark or a browser (SLOW_MODULES in tests/conftest.py), or when it took
QUICK_S or longer in the last measured full run. The file is measured on purpose, not at every run
(so a test's mark does not depend on this run's load): `make durations` runs the whole suite with a
JUnit XML report and folds its times in (`python tests/durations.py update REPORT.xml`); a test not yet
measured counts as quick. Keys are `module::test` (the file's name without its folder), so moving a
test between room folders keeps its time.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FILE = Path(__file__).resolve().parent / "durations.json"
#: a test measured at this many seconds or more (whole suite, 2 cores, load about 6) is left out of
#: the quick pass
QUICK_S = 1.0


def key(module: str, name: str) -> str:
    return f"{module.rsplit('.', 1)[-1]}::{name}"


def load() -> dict[str, float]:
    try:
        data = json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def measured(report: Path) -> dict[str, float]:
    """`module::test` -> seconds from a pytest JUnit XML report (setup, call and teardown together)."""
    out: dict[str, float] = {}
    for case in ET.parse(report).iter("testcase"):
        parts = [p for p in (case.get("classname") or "").split(".") if p.startswith("test_")]
        if parts and case.find("skipped") is None:
            out[key(parts[0], case.get("name") or "")] = round(float(case.get("time") or 0), 2)
    return out


def update(report: Path) -> int:
    """Fold the report's times into the file: measured tests get their new time, the others keep theirs."""
    times = load() | measured(report)
    FILE.write_text(json.dumps(dict(sorted(times.items())), indent=0) + "\n")
    slow = sum(t >= QUICK_S for t in times.values())
    print(f"{FILE}: {len(times)} tests, {slow} at {QUICK_S} s or more")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "update":
        sys.exit("usage: python tests/durations.py update REPORT.xml")
    sys.exit(update(Path(sys.argv[2])))
