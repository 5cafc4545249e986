"""The memory this process may still use: MemAvailable and the memory cgroup's limit less its usage.

`INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK=1` (`SKIP_ENV`) tells every memory check built on these figures to stand aside.
"""

from __future__ import annotations

SKIP_ENV = "INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK"


def _read_int(path: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      text = f.read().strip()
  except (OSError, UnicodeDecodeError):
    return None
  return int(text) if text.isdigit() else None


def memory_figures() -> tuple[int | None, int | None, int | None]:
  """(MemAvailable, the memory cgroup's limit, its usage) in bytes; None where unknown or unlimited."""
  mem_available = None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          mem_available = int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                  "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    limit = _read_int(limit_file)
    if limit is not None and limit < 2**60:
      return mem_available, limit, _read_int(usage_file)
  return mem_available, None, None


def available_memory() -> tuple[int | None, str]:
  """Bytes this process can still allocate, and where the figure comes from."""
  mem_available, limit, usage = memory_figures()
  found = [] if mem_available is None else [(mem_available, "MemAvailable")]
  if limit is not None:
    found.append((max(limit - (usage or 0), 0), "the cgroup memory limit less its usage"))
  return min(found) if found else (None, "unknown")
