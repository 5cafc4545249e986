"""Many processes: `jax.distributed` for `export`, `forward` and `diff` (one process per host, as MaxText runs).

`initialize(coordinator, num_processes, process_id)` starts JAX's distributed runtime from the command line's
`--coordinator HOST:PORT --num-processes N --process-id I`; without them it lets JAX detect a cluster (Slurm, Open
MPI, Cloud TPU, GKE, ...) when the environment names one, and otherwise stays a single process. Then
`process_index()`/`process_count()` say who this is, `barrier` waits for every process and `broadcast_text` sends a
string from process 0 to all.
"""

from __future__ import annotations

import os
import sys

from inspect_tool import errors

# Environment variables through which JAX's cluster detection finds a job it can join.
CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "MEGASCALE_COORDINATOR_ADDRESS",
               "TPU_WORKER_HOSTNAMES", "JOBSET_NAME", "MPI_LOCALNRANKS")
_TEXT_BYTES = 4096
_started = False


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Joins the job (see the module docstring); a no-op for a single process.

  Raises:
    errors.InputError: an incomplete or inconsistent set of flags, or the coordinator cannot be reached.
  """
  global _started  # pylint: disable=global-statement
  given = [v is not None for v in (coordinator, num_processes, process_id)]
  if any(given) and not all(given):
    raise errors.InputError("--coordinator, --num-processes and --process-id go together; accepted: all three "
                            "(e.g. --coordinator 10.0.0.1:1234 --num-processes 16 --process-id 0) or none")
  if all(given):
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise errors.InputError(f"--process-id {process_id} is not in [0, {num_processes}); accepted: 0 to "
                              f"{num_processes - 1} with --num-processes {num_processes}")
    if ":" not in coordinator:
      raise errors.InputError(f"--coordinator {coordinator!r} is not HOST:PORT; accepted: e.g. 10.0.0.1:1234")
    if num_processes == 1:
      return
  elif not any(name in os.environ for name in CLUSTER_ENV):
    return
  import jax  # pylint: disable=import-outside-toplevel

  if _cpu_only():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through Gloo
  try:
    if all(given):
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                 process_id=process_id, initialization_timeout=120)
    else:
      jax.distributed.initialize()
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    raise errors.InputError(f"cannot join the distributed job ({first})") from None
  _started = True
  _keep_stdout_for_data()


def _keep_stdout_for_data() -> None:
  """Gloo (JAX's CPU collectives) prints connection lines on the C stdout: from now on the C stdout is stderr,
  and Python's `sys.stdout` (the tool's data) keeps the real one."""
  sys.stdout.flush()
  data = os.dup(1)
  os.dup2(2, 1)
  sys.stdout = os.fdopen(data, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8")


def _cpu_only() -> bool:
  return os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"


def process_index() -> int:
  if not _started:
    return 0
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_index()


def process_count() -> int:
  if not _started:
    return 1
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_count()


def barrier(name: str) -> None:
  """Returns once every process has reached the barrier `name`."""
  if process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def broadcast_text(text: str | None) -> str:
  """Process 0's `text`, on every process (others pass None)."""
  if process_count() == 1:
    return text or ""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  raw = (text or "").encode()
  if len(raw) > _TEXT_BYTES:
    raise errors.InputError(f"path too long for the other processes ({len(raw)} bytes; accepted: {_TEXT_BYTES})")
  buffer = np.frombuffer(raw.ljust(_TEXT_BYTES, b"\0"), np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return bytes(out).rstrip(b"\0").decode()


def to_host(value):
  """`value` (a dataclass or pytree of arrays) with every array as a whole numpy array on this process.

  Arrays that span other processes' devices are gathered (`process_allgather`); every process takes part.
  """
  import dataclasses  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  if value is None:
    return None
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclasses.replace(value, **{f.name: to_host(getattr(value, f.name))
                                         for f in dataclasses.fields(value)})

  def gather(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x

  return jax.tree.map(gather, value)
