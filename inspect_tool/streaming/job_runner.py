"""The write sequence every streaming command runs, on one process or many: `plan` then `run`.

`export` (both layouts) and `import` give only what differs: their arrays' plan, how they write into the temporary
destination, what every process does once the writing is merged (the manifest), and the report process 0 writes.
The sequence is the runner's alone:

1. `plan`: the bytes process 0 holds are every process's (`held`), so that every process cuts the arrays the same
   way; the jobs are planned and the processes agree on them (`job_plan.agree_on_plan`), or none writes;
2. `run`: the temporary destination (process 0's, its path sent to the others), the test point "start", the
   writing, the barrier "finalized" (process 0 has merged what every process wrote), what every process does then;
   the other processes wait at "committed" while process 0 checks for a stop, passes "written", makes and writes
   the report, passes "report", checks again and commits; then every process passes "committed".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Protocol

from inspect_tool.distributed import runtime as distributed
from inspect_tool.output import atomic
from inspect_tool.output import stop
from inspect_tool.streaming import budget
from inspect_tool.streaming import job_plan
from inspect_tool.streaming import write_orbax


@dataclasses.dataclass(frozen=True)
class Memory:
  """How a run held its memory, the report's `memory` section: the budget, the slices it cut, the largest, and how
  many processes wrote."""
  max_memory: int
  slices: int
  largest_slice_bytes: int
  processes: int

  @classmethod
  def of(cls, jobs, max_memory: int, **more) -> "Memory":
    """The figures of `jobs` (and `more`, the fields of a subclass)."""
    return cls(max_memory=max_memory, slices=sum(job.slicing.count for job in jobs),
               largest_slice_bytes=max((job.slice_bytes for job in jobs), default=0),
               processes=distributed.process_count(), **more)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def plan(arrays_plan, source, max_memory: int, kept: int) -> list[write_orbax.ArrayJob]:
  """The jobs of every array of `source` under `max_memory` (`write_orbax.plan_jobs`), the same on every process:
  cut beside what process 0 holds (its resident size plus `kept`, the allocator's kept blocks), agreed by all."""
  index = distributed.process_index()
  held = int(distributed.broadcast_text(str(budget.current_rss() + kept) if index == 0 else None))
  jobs = write_orbax.plan_jobs(arrays_plan, source, max_memory, held)
  job_plan.agree_on_plan(jobs)  # every process runs exactly the same plan, or none writes
  stop.check()
  return jobs


class Report(Protocol):
  """A run's report: a typed record whose `to_dict()` is the JSON file written beside the data."""

  def to_dict(self) -> dict:
    ...


def run(dst: str, overwrite: bool, report_name: str, write: Callable[[str], Any],
        report: Callable[[str, Any, Any], Report], merged: Callable[[str, Any], Any] | None = None) -> Report | None:
  """Writes DST: `write(tmp)` on every process (returns what it wrote), `merged(tmp, written)` on every process
  once process 0 has merged the writes, then on process 0 `report(tmp, written, merged's result)`, written as
  `report_name` before the commit. Returns the report on process 0, None on the others."""
  with job_plan.temporary_directory(dst, overwrite) as tmp:
    atomic.test_point("start")
    written = write(tmp)
    distributed.barrier("finalized")  # process 0 has merged the databases: what others wrote can be read back
    after = merged(tmp, written) if merged is not None else None
    if distributed.process_index() != 0:
      distributed.barrier("committed")  # process 0 has checked, reported and committed (or says why not)
      return None
    stop.check()
    atomic.test_point("written")
    document = report(tmp, written, after)
    atomic.write_inside(tmp, report_name, json.dumps(document.to_dict(), indent=1) + "\n")
    atomic.test_point("report")
    stop.check()
  distributed.barrier("committed")
  return document
