"""Test hooks at named points of a run: SIGKILL the process there, or pause it until a file is removed."""

from __future__ import annotations

import os
import signal
import time

KILL_ENV = "INSPECT_EXPORT_KILL_AT"  # tests: SIGKILL the process at the named point
PAUSE_ENV = "INSPECT_EXPORT_PAUSE_AT"  # tests: "<point>:<file>": create <file> at the point, wait until it is gone


def test_point(name: str, before=None) -> None:
  """Test hooks at the named point of a run: SIGKILL ($INSPECT_EXPORT_KILL_AT) or pause ($INSPECT_EXPORT_PAUSE_AT)."""
  pause = os.environ.get(PAUSE_ENV, "")
  if pause.partition(":")[0] == name:
    flag = pause.partition(":")[2]
    with open(flag, "w", encoding="utf-8") as f:
      f.write(f"{os.getpid()}\n")
    while os.path.exists(flag):
      time.sleep(0.02)
  if os.environ.get(KILL_ENV) == name:
    if before is not None:
      before()
    os.kill(os.getpid(), signal.SIGKILL)
