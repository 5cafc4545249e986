"""Many processes: one process per host, as MaxText runs, for `export`, `import`, `forward` and `diff`.

`initialize(coordinator, num_processes, process_id, timeout=..., jax_runtime=...)` joins the job of the command
line's `--coordinator HOST:PORT --num-processes N --process-id I`. `forward` and `diff` compute across processes
and start JAX's distributed runtime (`jax_runtime=True`; without the flags JAX detects a cluster, e.g. Slurm, Open
MPI, Cloud TPU, GKE, when the environment names one of several processes: `cluster_variable`). A single-host TPU VM
names itself alone in `TPU_WORKER_HOSTNAMES` and runs as one process, as MaxText's trainer does there. `export` and
`import` only agree and write their own shares: they join a `job.Job` (TCP through process 0, bounded waits,
one-line failures) instead. The address is checked
before anything is started. Then `process_index()`/`process_count()` say who this is, `barrier` waits for every
process, `broadcast_text` sends a string from process 0 to all and `gather_text` gives every process's string to
all; `abandon(message)` tells the other processes that this one failed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import sys

from inspect_tool import process_state
from inspect_tool import errors
from inspect_tool.distributed import job
from inspect_tool.output import stop

# Environment variables through which JAX's cluster detection finds a job it can join.
CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "MEGASCALE_COORDINATOR_ADDRESS",
               "TPU_WORKER_HOSTNAMES", "JOBSET_NAME", "MPI_LOCALNRANKS")
# Per variable: the variable that holds its job's process count (a number) or host names (a comma list); None when
# naming the variable is enough to mean a job of several processes.
_SIZE_OF = {"SLURM_JOB_ID": "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
            "MPI_LOCALNRANKS": "PMI_SIZE", "TPU_WORKER_HOSTNAMES": "TPU_WORKER_HOSTNAMES",
            "JOBSET_NAME": "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS": None,
            "MEGASCALE_COORDINATOR_ADDRESS": None}
DEFAULT_TIMEOUT = 300.0  # seconds a process waits for another (joining, a barrier) before the job is abandoned
_TEXT_BYTES = 4096
_started = False
_job = None  # job.Job of an export or import
_exchanges = 0  # running number of the unnamed exchanges (every process makes them in the same order)


def parse_coordinator(text: str) -> tuple[str, int]:
  """(host, port) of `--coordinator HOST:PORT`: a host name that resolves or an IP address ([v6] in brackets),
  and a port in 1..65535.

  Raises:
    errors.InputError: anything else (a scheme such as http://, an empty host, a port out of range).
  """
  accepted = "accepted: HOST:PORT with a host name or IP address and a port 1-65535, e.g. 10.0.0.1:1234"
  shown = repr(text[:200])
  if "://" in text or "/" in text:
    raise errors.InputError(f"--coordinator {shown} is not HOST:PORT (no scheme or path); {accepted}")
  host, sep, port = text.rpartition(":")
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  if not sep or not host.strip() or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise errors.InputError(f"--coordinator {shown} is not HOST:PORT; {accepted}")
  try:
    ipaddress.ip_address(host)
  except ValueError:
    try:
      socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
      reason = getattr(e, "strerror", None) or type(e).__name__
      raise errors.InputError(f"--coordinator host {host[:200]!r} does not resolve ({reason}); {accepted}") from None
  return host, int(port)


def _processes(value: str) -> int:
  """The process count a size variable holds: a number, or one process per name of a comma-separated host list."""
  value = value.strip()
  if value.isdigit():
    return int(value)
  return len([name for name in value.split(",") if name.strip()])


def cluster_variable(environ=os.environ) -> str | None:
  """The first environment variable that names a job of several processes for JAX to join, else None.

  A single-host TPU VM sets `TPU_WORKER_HOSTNAMES` to its one worker (`localhost`), Slurm and Open MPI name one task:
  one process, nothing to join. A variable whose size is not set (`SLURM_JOB_ID` without `SLURM_NTASKS`, a GKE
  `JOBSET_NAME` without worker names) is left to JAX's detection, as MaxText does.
  """
  for name in CLUSTER_ENV:
    if name not in environ:
      continue
    size = _SIZE_OF[name]
    if size is None or size not in environ or _processes(environ[size]) > 1:
      return name
  return None


_planned: list[tuple] = []  # the job the flags name, until this process joins it: (host, port, count, index, timeout)
process_state.declare(f"{__name__}:_planned,_started,_job,_exchanges", process_state.RUN,
                      lambda: {k: v for k, v in (("planned", list(_planned)), ("joined", _started), ("job", _job))
                               if v})


def check_flags(coordinator: str | None, num_processes: int | None, process_id: int | None,
                timeout: float | None = None) -> bool:
  """Checks the distributed flags without starting anything; True when they name a job of several processes.

  Raises:
    errors.InputError: an incomplete or inconsistent set of flags, or a bad address or timeout.
  """
  if timeout is not None and not 0 < timeout <= 86400:
    raise errors.InputError(f"--timeout {timeout} is not a number of seconds; accepted: more than 0, at most 86400")
  given = [v is not None for v in (coordinator, num_processes, process_id)]
  if any(given) and not all(given):
    raise errors.InputError("--coordinator, --num-processes and --process-id go together; accepted: all three "
                            "(e.g. --coordinator 10.0.0.1:1234 --num-processes 16 --process-id 0) or none")
  if not all(given):
    return False
  if num_processes < 1:
    raise errors.InputError(f"--num-processes {num_processes} is not a process count; accepted: 1 or more")
  if not 0 <= process_id < num_processes:
    raise errors.InputError(f"--process-id {process_id} is not in [0, {num_processes}); accepted: 0 to "
                            f"{num_processes - 1} with --num-processes {num_processes}")
  host, port = parse_coordinator(coordinator)
  if num_processes > 1:
    _planned[:] = [(host, port, num_processes, process_id, timeout)]
  return num_processes > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout: float | None = None, jax_runtime: bool = True) -> None:
  """Joins the job (see the module docstring); a no-op for a single process.

  Raises:
    errors.InputError: an incomplete or inconsistent set of flags, or the coordinator cannot be reached.
  """
  global _started, _job  # pylint: disable=global-statement
  given_timeout = timeout
  timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
  several = check_flags(coordinator, num_processes, process_id, timeout)
  if coordinator is not None and not several:
    return
  variable = cluster_variable() if coordinator is None else None
  if coordinator is None and variable is None:
    return
  if several and not jax_runtime:
    host, port = parse_coordinator(coordinator)
    _planned.clear()
    _job = job.Job(host, port, num_processes, process_id, timeout,
                   refused_s=timeout if given_timeout is not None else job.REFUSED_S)
    return
  # lazy: JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
  import jax  # pylint: disable=import-outside-toplevel

  if _cpu_only():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through Gloo
  jax.config.update("jax_enable_preemption_service", False)  # its notifier would take SIGTERM from us
  try:
    if several:
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                 process_id=process_id, initialization_timeout=max(1, int(timeout)))
    else:
      jax.distributed.initialize(initialization_timeout=max(1, int(timeout)))
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    if variable is not None:  # the environment asked, not the user's flags
      raise errors.InputError(f"cannot join the distributed job that {variable}={os.environ[variable][:100]!r} names "
                              f"({first}); accepted: a reachable job, or unset {variable} to run as one process"
                              ) from None
    raise errors.InputError(f"cannot join the distributed job ({first})") from None
  finally:
    stop.install_handlers()  # whatever JAX installed, SIGTERM/SIGHUP/SIGINT/SIGQUIT stop the run our way
  _started = True
  _keep_stdout_for_data()


def abandon(message: str) -> None:
  """Tells the other processes of an export or import job that this one failed (`message`); best effort. A
  process that failed before joining (a bad input of its own) tells process 0, which would otherwise wait for it."""
  global _job  # pylint: disable=global-statement
  if _job is not None:
    _job.fail(message)
    _job = None
  elif _planned:
    host, port, count, index, _ = _planned.pop()
    if index != 0:
      job.notify_failure(host, port, count, index, message)


def finish() -> None:
  """Closes this process's part of an export or import job (after its last exchange)."""
  global _job  # pylint: disable=global-statement
  if _job is not None:
    _job.close()
    _job = None


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
  if _job is not None:
    return _job.index
  if not _started:
    return 0
  # lazy: JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_index()


def process_count() -> int:
  if _job is not None:
    return _job.count
  if not _started:
    return 1
  # lazy: JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_count()


def barrier(name: str) -> None:
  """Returns once every process has reached the barrier `name`."""
  if _job is not None:
    _job.exchange(name, "")
  elif process_count() > 1:
    # lazy: JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def broadcast_text(text: str | None) -> str:
  """Process 0's `text`, on every process (others pass None)."""
  if process_count() == 1:
    return text or ""
  if _job is not None:
    return gather_text(text or "")[0]
  # lazy: NumPy, ~0.05 s to import; JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  raw = (text or "").encode()
  if len(raw) > _TEXT_BYTES:
    raise errors.InputError(f"path too long for the other processes ({len(raw)} bytes; accepted: {_TEXT_BYTES})")
  buffer = np.frombuffer(raw.ljust(_TEXT_BYTES, b"\0"), np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return bytes(out).rstrip(b"\0").decode()


def gather_text(text: str) -> list[str]:
  """Every process's `text`, in process order, on every process (each process calls this, in the same order)."""
  global _exchanges  # pylint: disable=global-statement
  if process_count() == 1:
    return [text]
  _exchanges += 1
  if _job is not None:
    return _job.exchange(f"exchange {_exchanges}", text)
  # lazy: NumPy, ~0.05 s to import; JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  raw = text.encode()[:_TEXT_BYTES]
  buffer = np.frombuffer(raw.ljust(_TEXT_BYTES, b"\0"), np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buffer))
  return [bytes(row).rstrip(b"\0").decode() for row in rows.reshape(-1, _TEXT_BYTES)]


def to_host(value):
  """`value` (a dataclass or pytree of arrays) with every array as a whole numpy array on this process.

  Arrays that span other processes' devices are gathered (`process_allgather`); every process takes part.
  """
  # lazy: JAX, ~0.6 s to import; NumPy, ~0.05 s to import: `--help`, `export --help` load this module without it
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  if value is None:
    return None
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclasses.replace(value, **{f.name: to_host(getattr(value, f.name))
                                         for f in dataclasses.fields(value)})

  def gather(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      # lazy: JAX, ~0.6 s to import: `--help`, `export --help` load this module without it
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x

  return jax.tree.map(gather, value)
