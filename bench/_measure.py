"""What the bench scripts share: one process timed (wall, CPU, peak RSS; killed past a limit), the smallest
`--max-memory` a command accepts (read from its refusal line) and medians of repeated runs.

Not a benchmark itself (`tests/test_bench.py` runs every `bench/*.py` but this one).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import statistics
import subprocess

ACCEPTED = re.compile(r"accepted: (at least|more than) ([0-9.]+) (GiB|MiB|KiB|B)\b")
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
FIRST_ASK = 1_000_000  # bytes: under any process's floor


@dataclasses.dataclass(frozen=True)
class Run:
  """One process: wall and CPU (user + system) seconds, peak RSS bytes, its output; `timed_out`: killed at the
  limit (wall is then the limit, CPU and RSS unknown)."""

  wall: float
  cpu: float
  rss: int
  returncode: int
  stdout: str = ""
  stderr: str = ""
  timed_out: bool = False


def timed(cmd: list[str], env, *, cwd: str, limit: float | None = None, ok=(0,)) -> Run:
  """Runs `cmd` under /usr/bin/time in its own process group; past `limit` seconds the group is killed.

  Raises:
    RuntimeError: the exit status is not in `ok` (its stderr's tail in the message).
  """
  proc = subprocess.Popen(["/usr/bin/time", "-f", "TIME %e %U %S %M"] + cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=limit)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the group this call started: /usr/bin/time and the command
    out, err = proc.communicate()
    return Run(float(limit), math.nan, 0, -signal.SIGKILL, out, err, timed_out=True)
  lines = [line for line in err.splitlines() if line.startswith("TIME ")]
  if proc.returncode not in ok or not lines:
    raise RuntimeError(f"{' '.join(cmd[:8])} ... exit {proc.returncode}: {err[-2000:]}")
  _, wall, user, system, rss_kb = lines[-1].split()
  return Run(float(wall), float(user) + float(system), int(rss_kb) * 1024, proc.returncode, out, err)


def memory_floor(cmd: list[str], env, *, cwd: str, tries: int = 3) -> int:
  """The smallest `--max-memory` (bytes) `cmd` accepts: asked with 1 MB, it refuses naming what it accepts
  ("accepted: at least X", or "more than X" for what the process holds at start, then asked again just above).

  Raises:
    RuntimeError: a refusal without such a line, or no "at least" within `tries` asks.
  """
  ask = FIRST_ASK
  for _ in range(tries):
    run = timed(cmd + ["--max-memory", str(ask)], env, cwd=cwd, ok=(0, 1, 2))
    if run.returncode in (0, 1):
      return ask  # accepted (only after a "more than" answer)
    found = ACCEPTED.search(run.stderr)
    if found is None:
      raise RuntimeError(f"no 'accepted:' size in the refusal of {' '.join(cmd[:8])} ...: {run.stderr[-1000:]}")
    size = math.ceil(float(found.group(2)) * UNITS[found.group(3)])
    if found.group(1) == "at least":
      return size
    ask = math.ceil(size * 1.02) + 1
  raise RuntimeError(f"{' '.join(cmd[:8])} ... named no smallest budget in {tries} asks")


def mib(nbytes: float) -> str:
  """A `--max-memory` value in whole MiB (rounded up), as the tool parses it."""
  return f"{math.ceil(nbytes / 2**20)}MiB"


def summary(runs: list[Run]) -> dict:
  """Median wall and CPU seconds, every wall, largest peak RSS; `timed_out` when any run was killed."""
  walls = [r.wall for r in runs]
  return {"wall_seconds": statistics.median(walls), "wall_seconds_runs": walls,
          "cpu_seconds": statistics.median(r.cpu for r in runs), "peak_rss_bytes": max(r.rss for r in runs),
          "timed_out": any(r.timed_out for r in runs)}
