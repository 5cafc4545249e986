"""The memory budget of export and import: `--max-memory`, the memory the process holds, and how slices are shaped.

Every array is read in chunk-aligned boxes and quantized and written one slice at a time (`read_plan`). A slice of
`b` source bytes costs about `SLICE_FACTOR * b` of memory (its compute-dtype cast, the quantizer's temporaries,
the encoded output and its write in flight), beside the box it is cut from. The destination array is chunked by a
sub-block of the slice (`chunk_within`), so every write fills whole chunks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import math
import os
import resource
from typing import Iterator, Sequence

from inspect_tool import process_state
from inspect_tool import errors
from inspect_tool.configuration import sizes
from inspect_tool.host import memory as host_memory
from quant import compat

SLICE_FACTOR = 8  # peak bytes per source byte of a slice, with margin (about 4-5 measured; bench/bench_export.py)
DEFAULT_SHARE = 0.5  # default --max-memory: this share of the memory available to the process
FREED_MEMORY_THRESHOLD = 1 << 20  # glibc's mmap and trim thresholds while streaming under a tight budget
KEPT_SHARE = 256  # with room to spare, freed blocks up to 1/KEPT_SHARE of the room are kept for reuse
KEPT_BLOCK_MIN = 16 << 20  # ... from this size on (a room of 4 GiB); below it, every block of 1 MiB is handed back
KEPT_BLOCK_MAX = 32 << 20  # the largest mmap threshold glibc takes on 64-bit hosts (half its heap size)
KEPT_FACTOR = 16  # memory set aside for the kept blocks, per byte of the threshold (measured: 10-11, bench_gcs)
_hand_back_above: int | None = None  # the resident size past which kept blocks go back (`keep_within`)


def _forget_hand_back() -> None:
  global _hand_back_above  # pylint: disable=global-statement
  _hand_back_above = None


process_state.declare(f"{__name__}:_hand_back_above", process_state.SETTING, lambda: _hand_back_above,
                      _forget_hand_back)
# Compiling and compiled quantizers, tensorstore's buffers, beside the slices of an export or import (`write_orbax`).
# Measured: `--max-memory 600MB` on the benchmark's embedding source holds 0.26 GB when slicing starts and peaks at
# 0.39 GB (bench/bench_export.py).
RESERVE_BYTES = 96 * 2**20
# Beside it when the write quantizes: the quantizers compiled while slices are in flight. Their block shapes follow
# the budget, so at a budget not met before every one misses the compilation cache: the floor test's export at
# 345 MiB peaked at 321 MB with its quantizers in the cache and at 357-365 MB without (tests/test_export_chunks_memory).
COMPILE_RESERVE_BYTES = 32 * 2**20


def reserve_bytes(quantizes: bool) -> int:
  """What a write sets aside beside the slices: `RESERVE_BYTES`, plus `COMPILE_RESERVE_BYTES` when it quantizes."""
  return RESERVE_BYTES + (COMPILE_RESERVE_BYTES if quantizes else 0)


def parse_size(text: str, option: str = "--max-memory") -> int:
  """Bytes of a size like `600MB`, `2GiB`, `1.5G` or `1000000` (k, M, G, T: powers of 1000; `sizes`).

  Raises:
    errors.InputError: not such a size.
  """
  return sizes.parse_size(text, option, sizes.DECIMAL_UNITS)


def format_size(nbytes: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= size:
      return f"{nbytes / size:.1f} {unit}"
  return f"{int(nbytes)} B"


def memory_ceiling() -> tuple[int | None, str]:
  """The most this process's resident memory can reach, and where the figure comes from: what it holds plus
  MemAvailable, capped by its memory cgroup's limit (whose usage also counts reclaimable page cache)."""
  mem_available, limit, _ = host_memory.memory_figures()
  found = [] if mem_available is None else [(mem_available + current_rss(), "MemAvailable and what it holds")]
  if limit is not None:
    found.append((limit, "the memory cgroup's limit"))
  return min(found) if found else (None, "unknown")


def default_max_memory() -> int:
  """The default `--max-memory`: half of the memory ceiling (of physical memory when that is unknown)."""
  ceiling, _ = memory_ceiling()
  if ceiling is None:
    ceiling = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return int(ceiling * DEFAULT_SHARE)


def resolve_max_memory(max_memory: int | None) -> int:
  """`--max-memory` in bytes: the default when None; refused when over the memory ceiling.

  Raises:
    errors.InputError: `max_memory` is more than this process can reach (unless
      $INSPECT_CHECKPOINT_SKIP_MEMORY_CHECK=1).
  """
  if max_memory is None:
    return default_max_memory()
  ceiling, source = memory_ceiling()
  if ceiling is not None and os.environ.get(host_memory.SKIP_ENV) != "1" and max_memory > ceiling:
    raise errors.InputError(f"--max-memory {format_size(max_memory)} is more than this process can get: "
                            f"{format_size(ceiling)} ({source}); accepted: a size up to {format_size(ceiling)}")
  return int(max_memory)


def check_floor(max_memory: int) -> None:
  """Refuses a `--max-memory` that is not above what this process already holds (its resident memory, the
  floor under which nothing can be read).

  Raises:
    errors.InputError: `max_memory` <= the resident memory now.
  """
  held = current_rss()
  if max_memory <= held:
    raise errors.InputError(f"--max-memory {format_size(max_memory)} is not above the {format_size(held)} this "
                            f"process already holds; accepted: more than {format_size(held)}")


def current_rss() -> int:
  """Resident bytes of this process now."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class Slicing:
  """How one array is cut: the block shape (also the destination chunk shape) and the grid of blocks."""

  shape: tuple[int, ...]
  block: tuple[int, ...]

  @property
  def count(self) -> int:
    return math.prod(-(-d // b) for d, b in zip(self.shape, self.block)) if self.shape else 1

  def slices(self) -> Iterator[tuple[slice, ...]]:
    """Index tuples of every block, in C order."""
    ranges = [range(0, d, b) for d, b in zip(self.shape, self.block)]
    for starts in itertools.product(*ranges):
      yield tuple(slice(s, min(s + b, d)) for s, b, d in zip(starts, self.block, self.shape))


def _even_block(length: int, most: int) -> int:
  """`most`, or the largest divisor of `length` not below `most / 2`: equal slices, so one compiled quantizer."""
  for size in range(most, max(1, most // 2) - 1, -1):
    if length % size == 0:
      return size
  return most


def chunk_within(block: Sequence[int], itemsize: int, limit: int, cuttable: Sequence[int]) -> tuple[int, ...]:
  """A sub-block of `block` of about `limit` bytes whose sides divide `block`'s (so that every slice covers whole
  chunks), cutting `cuttable` axes outermost first; an axis without a divisor near the wanted size stays whole."""
  chunk = [int(b) for b in block]
  for axis in sorted(set(cuttable)):
    size = math.prod(chunk) * itemsize
    if size <= limit:
      break
    want = max(1, limit // max(size // max(chunk[axis], 1), 1))
    divisor = _even_block(chunk[axis], min(want, chunk[axis]))
    if chunk[axis] % divisor == 0:
      chunk[axis] = divisor
  return tuple(chunk)


def kept_block_bytes(room: int) -> int:
  """The largest freed block the allocator keeps for reuse while streaming with `room` bytes beside the process:
  1/`KEPT_SHARE` of the room, at most `KEPT_BLOCK_MAX`; `FREED_MEMORY_THRESHOLD` (every block of 1 MiB or more
  handed back when freed) when that share is under `KEPT_BLOCK_MIN`."""
  block = min(KEPT_BLOCK_MAX, max(0, room) // KEPT_SHARE)
  return block if block >= KEPT_BLOCK_MIN else FREED_MEMORY_THRESHOLD


def streaming_allocations(max_memory: int) -> int:
  """Allocation settings for streaming work under `max_memory`, whose large buffers each live for one box, slice
  or chunk; returns the bytes to count as held beside the resident size for the blocks the allocator keeps.

  glibc raises its mmap threshold after each large free by default (up to 32 MiB), so buffers of every size end up
  in heap arenas that are not given back, and the resident size creeps up over many slices. Fixed thresholds
  instead (no-op without glibc). With a room of 4 GiB or more, blocks under `kept_block_bytes(room)` (the
  chunk-sized buffers of tensorstore's reads, encodings and writes) are kept and reused, `KEPT_FACTOR` times the
  threshold is set aside for them in the plan, and `keep_within` hands them back should the process pass the budget
  less that; larger blocks are mapped when allocated and handed back when freed. A fresh page is zeroed at its first
  touch, and on a virtual machine that hands freed memory back to its host (free page reporting) each costs a fault
  on the host too: bench_gcs's export local -> local, 8.81 s with every block of 1 MiB or more handed back, 7.07 s
  with blocks under 32 MiB kept (peak RSS 1.12 -> 1.42 GB; docs/benchmarks.md). With less room every block of
  1 MiB or more is handed back and nothing is set aside: what the allocator keeps is not proportional to its
  threshold (measured 50-80 MB more at 2-4 MiB, over 16 times that). numpy's arrays also get no
  transparent-huge-page advice: each fresh huge page is zeroed whole at its first touch (10.5-11.5 s with the
  advice, 8.1-8.9 s without).
  """
  global _hand_back_above  # pylint: disable=global-statement
  compat.numpy_huge_page_advice(False)
  block = kept_block_bytes(max_memory - current_rss())
  _hand_back_above = None
  libc = _libc()
  if libc is None:
    return 0
  m_trim_threshold, m_mmap_threshold = -1, -3
  if not libc.mallopt(m_mmap_threshold, block):
    return 0
  libc.mallopt(m_trim_threshold, block if block == FREED_MEMORY_THRESHOLD else 2 * block)
  if block == FREED_MEMORY_THRESHOLD:
    return 0
  _hand_back_above = max_memory - KEPT_FACTOR * block
  return KEPT_FACTOR * block


def keep_within() -> None:
  """Hands the kept blocks back once the resident size passes `--max-memory` less what was set aside for them
  (called at every write: what the allocator keeps never takes the plan's own room); a no-op when none are kept."""
  if _hand_back_above is not None and current_rss() > _hand_back_above:
    hand_back_freed()


def hand_back_freed() -> None:
  """Hands the freed memory the allocator keeps back to the system (glibc's `malloc_trim`; no-op without it)."""
  libc = _libc()
  if libc is not None and hasattr(libc, "malloc_trim"):
    libc.malloc_trim(0)


@functools.cache
def _libc():
  """glibc, opened once; None where there is none."""
  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None
