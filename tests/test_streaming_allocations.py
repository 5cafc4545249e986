"""`budget.streaming_allocations`: with room to spare, freed chunk-sized blocks are reused (no fresh pages, counted
by the kernel's minor faults), with memory set aside for them; with less room every block of 1 MiB or more
goes back to the system when freed, and `keep_within` sends back what was kept once the process passes the budget less
what was set aside."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inspect_tool.streaming import budget

MIB, GIB = 2**20, 2**30


@pytest.mark.parametrize("room, block", [(0, MIB), (GIB, MIB), (4 * GIB - 1, MIB), (4 * GIB, 16 * MIB),
                                         (6 * GIB, 24 * MIB), (8 * GIB, 32 * MIB), (600 * GIB, 32 * MIB)])
def test_the_kept_block_is_a_share_of_the_room_up_to_glibcs_largest(room, block):
  assert budget.kept_block_bytes(room) == block


# A 16 MiB block (a chunk of bench_gcs's export) allocated, written, freed, then again: the minor faults of each
# writing, in a fresh process (the allocator's settings are the process's).
_PROBE = r"""
import json, resource, sys
import numpy as np
from inspect_tool.streaming import budget
room = int(sys.argv[1])
kept = budget.streaming_allocations(budget.current_rss() + room)
def faults_of_a_block():
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = np.empty(16 << 20, np.uint8)
  block.fill(1)
  del block
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
first, second = faults_of_a_block(), faults_of_a_block()
budget.keep_within()  # far under the budget: kept
within = faults_of_a_block()
budget.current_rss = lambda: 1 << 50  # a resident size past the budget
budget.keep_within()
print(json.dumps({"kept": kept, "first": first, "second": second, "within": within,
                  "after_hand_back": faults_of_a_block()}))
"""


def _probe(room: int) -> dict:
  out = subprocess.run([sys.executable, "-c", _PROBE, str(room)], capture_output=True, text=True, check=True)
  return json.loads(out.stdout)


def test_with_room_to_spare_a_freed_chunk_is_reused_and_set_aside():
  found = _probe(8 * GIB)
  assert found["kept"] == budget.KEPT_FACTOR * 32 * MIB
  assert found["first"] >= 3900  # 16 MiB: 4096 pages of 4 KiB, nearly all fresh
  assert found["second"] < 64 and found["within"] < 64  # the same memory again
  assert found["after_hand_back"] >= 3900  # past the budget, handed back: fresh pages once more


def test_with_less_room_a_freed_chunk_goes_back_to_the_system():
  found = _probe(3 * GIB)
  assert found["kept"] == 0
  assert found["first"] >= 3900 and found["second"] >= 3900
