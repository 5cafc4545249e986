"""Running a command inside a memory cgroup (v1, as root): its limit applies to that command alone, and its peak RSS
comes from /usr/bin/time."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import uuid

CGROUP_ROOT = "/sys/fs/cgroup/memory"
from conftest import REPO


def available() -> bool:
  return os.path.isdir(CGROUP_ROOT) and os.access(CGROUP_ROOT, os.W_OK)


@dataclasses.dataclass
class Cgroup:
  path: str
  charged: int | None = None  # the cgroup's peak usage, read when the block ends


@contextlib.contextmanager
def limited(limit: int, name: str):
  """A fresh memory cgroup limited to `limit` bytes for the block; removed afterwards, its peak usage kept."""
  group = Cgroup(os.path.join(CGROUP_ROOT, f"inspect_{name}_{uuid.uuid4().hex[:8]}"))
  os.mkdir(group.path)
  try:
    with open(os.path.join(group.path, "memory.limit_in_bytes"), "w", encoding="ascii") as f:
      f.write(str(limit))
    yield group
    with open(os.path.join(group.path, "memory.max_usage_in_bytes"), encoding="ascii") as f:
      group.charged = int(f.read())
  finally:
    os.rmdir(group.path)


def run_tool(args: list[str], cgroup: Cgroup | None = None, timeout: int = 900, env: dict[str, str] | None = None):
  """`python -m inspect_tool ARGS` (joining `cgroup` before exec when given; `env` over this environment):
  (completed process with /usr/bin/time's lines removed from stderr, peak RSS in bytes)."""
  join = 'if [ -n "$0" ]; then echo $$ > "$0/cgroup.procs"; fi && exec "$@"'
  cmd = ["sh", "-c", join, cgroup.path if cgroup else "", "/usr/bin/time", "-f", "PEAK_RSS_KB %M", sys.executable,
         "-m", "inspect_tool", *args]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
                       check=False, timeout=timeout)
  lines = out.stderr.splitlines()
  peak = [int(line.split()[1]) * 1024 for line in lines if line.startswith("PEAK_RSS_KB")]
  out.stderr = "\n".join(l for l in lines if not l.startswith(("PEAK_RSS_KB", "Command exited with non-zero")))
  return out, (peak or [None])[-1]


def accepted_floor(out) -> int:
  """The smallest `--max-memory` a refused run names (its one line ends "accepted: at least N MiB"), in bytes; asserts
  the run was refused with exit 2 and said so."""
  assert out.returncode == 2 and "accepted: at least " in out.stderr, out.stderr[-2000:]
  number, unit = out.stderr.rsplit("accepted: at least ", 1)[1].split()[:2]
  return int(float(number) * {"GiB": 2**30, "MiB": 2**20}[unit])
