"""Writes tests/durations.json from a pytest JUnit XML report: the seconds of every test that took at least
`MIN_SECONDS` (setup and teardown included), by test id. `tests/conftest.py` marks the tests over its threshold
`heavy` (`make test-fast` leaves them out).

Run: make durations (the whole suite with --junitxml, then this script), or
     python scripts/test_durations.py REPORT.xml > tests/durations.json
"""

import json
import sys
import xml.etree.ElementTree as ET

MIN_SECONDS = 0.5


def main(report: str) -> None:
  durations = {}
  for case in ET.parse(report).iter("testcase"):
    module = case.get("classname", "").split(".")
    test_id = f"tests/{module[-1]}.py::{case.get('name')}"
    seconds = float(case.get("time") or 0)
    if seconds >= MIN_SECONDS:
      durations[test_id] = round(seconds, 1)
  json.dump(dict(sorted(durations.items())), sys.stdout, indent=0)
  sys.stdout.write("\n")


if __name__ == "__main__":
  main(sys.argv[1])
