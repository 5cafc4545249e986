"""One plan per job: the processes of a multi-process export or import agree before any of them writes.

Each process is given its own command line, so two can differ: other keys (`quantize_mtp=true` on one only: other
arrays), another `--checkpoint` or `--output`, or another `--max-memory` (its default is half of each host's
available memory, so real hosts differ) and so other cuts. Work is handed out by running number (`write_orbax`),
so any difference would write a checkpoint with arrays or chunks missing. Here:

- `agree_on_inputs`: the keys, source, destination and `--overwrite` must be the same on every process (else one
  line on every process, exit 2, nothing written); the memory budget of the job is the smallest process's, so
  every host stays under its own;
- `agree_on_plan`: the fingerprint of the planned arrays, cuts and chunks (the assignment follows from them) must
  be the same on every process (else the same kind of line).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Sequence

from inspect_tool import errors
from inspect_tool.distributed import runtime as distributed
from inspect_tool.output import atomic
from inspect_tool.storage import paths


def _differing(texts: Sequence[str]) -> list[int]:
  return [i for i, text in enumerate(texts) if text != texts[0]]


def agree_on_inputs(tokens: Sequence[str], source: str | None, dst: str, overwrite: bool, max_memory: int) -> int:
  """The job's memory budget (the smallest process's); raises unless every process has the same inputs.

  Raises:
    errors.InputError: a process was given other keys, source, destination or --overwrite than process 0.
  """
  if distributed.process_count() == 1:
    return max_memory

  inputs = {"keys": list(tokens), "--checkpoint": paths.absolute(source) if source else None,
            "--output": paths.absolute(dst), "--overwrite": bool(overwrite)}
  texts = distributed.gather_text(json.dumps({"inputs": inputs, "max_memory": int(max_memory)}, sort_keys=True))
  given = [json.loads(text) for text in texts]
  for name in inputs:
    values = [json.dumps(g["inputs"][name]) for g in given]
    if _differing(values):
      bad = _differing(values)[0]
      if name == "keys":
        mine, first = given[bad]["inputs"][name], given[0]["inputs"][name]
        extra = [k for k in mine if k not in first] or ["(none)"]
        lacks = [k for k in first if k not in mine] or ["(none)"]
        shown = f"{' '.join(extra)[:120]} where process 0 has {' '.join(lacks)[:120]}"
      else:
        shown = f"{values[bad][:120]} where process 0 has {values[0][:120]}"
      raise errors.InputError(f"the processes of this job were given different {name}: process {bad} has {shown}; "
                              f"accepted: the same {name} on every process; nothing was written")
  return min(int(g["max_memory"]) for g in given)


def fingerprint(jobs) -> str:
  """A digest of what a plan writes: every array's key, shape, dtype, quantization, slice block, chunk, passes,
  read box."""
  rows = [["/".join(job.leaf.key), list(job.leaf.shape), str(job.leaf.dtype), "/".join(map(str, job.out_key)),
           job.quant is not None, list(job.slicing.block), list(job.chunk), bool(job.two_pass),
           job.stored is not None, list(job.read_block), bool(job.ahead)] for job in jobs]
  return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def agree_on_plan(jobs) -> None:
  """Raises unless every process planned exactly the same arrays, cuts and chunks (before any writes).

  Raises:
    errors.InputError: the plans differ (the sources differ between hosts, or the planning inputs do).
  """
  if distributed.process_count() == 1:
    return
  texts = distributed.gather_text(f"{len(jobs)} {fingerprint(jobs)}")
  bad = _differing(texts)
  if bad:
    raise errors.InputError(
        f"the processes of this job planned different exports (process {bad[0]}: {texts[bad[0]].split()[0]} "
        f"arrays, process 0: {texts[0].split()[0]}; e.g. their --checkpoint holds other arrays or chunks); "
        "accepted: the same checkpoint and options on every process; nothing was written")


@contextlib.contextmanager
def temporary_directory(dst: str, overwrite: bool):
  """Process 0: the atomic temporary directory of DST (for gs://, its staging prefix), its path sent to the other
  processes; they get it and write their share there."""
  if distributed.process_index() != 0:
    yield distributed.broadcast_text(None)
    return
  with atomic.atomic_directory(dst, overwrite=overwrite) as tmp:
    distributed.broadcast_text(tmp)
    yield tmp
