"""The lock of a gs:// destination: one object beside it, created only if absent, kept alive by a heartbeat.

`.<name>.inspect-lock` (beside DST) is created by a conditional write (GCS `ifGenerationMatch=0` through
tensorstore): of two runs, exactly one creates it. It holds JSON: the run's `id` (its staging prefix), `host`,
`pid`, `heartbeat` (seconds since the epoch, rewritten every `HEARTBEAT_S` by a thread, conditional on the
generation it wrote last) and `state` ("writing", then "publishing" while DST is being replaced, with `staging`: the
id of the staging prefix being published). A lock is
stale when its process is gone (same host) or its heartbeat is older than `STALE_S` (another host); the next run
takes a stale lock over and hands its content to the caller, which cleans up after (or completes) that run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time

from inspect_tool import errors
from inspect_tool.output.ours import alive
from inspect_tool.storage import commit
from inspect_tool.storage import objects

HEARTBEAT_S = 10.0
STALE_S = 120.0


lock_url = commit.lock_url


def stale(content: dict, now: float | None = None) -> bool:
  """Whether the run that wrote the lock `content` is gone."""
  now = time.time() if now is None else now
  if content.get("host") == socket.gethostname() and isinstance(content.get("pid"), int):
    if not alive(content["pid"]) or content["pid"] == os.getpid():
      return True
  return now - float(content.get("heartbeat", 0)) > STALE_S


@dataclasses.dataclass
class Lock:
  """A held lock: `content` as last written, `previous` the stale lock taken over (None if there was none)."""

  url: str
  dst: str
  content: dict
  generation: bytes
  previous: dict | None = None
  lost: bool = False
  kept: bool = False

  def __post_init__(self):
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="gs-lock-heartbeat", daemon=True)
    self._thread.start()

  def _write(self, **changes) -> None:
    with self._lock:
      content = dict(self.content, **changes, heartbeat=time.time())
      generation = objects.write(self.url, json.dumps(content).encode(), if_generation=self.generation)
      if generation is None:
        self.lost = True
        raise errors.InputError(f"output {self.dst!r} was taken over by another inspect_checkpoint run "
                                "(this run's lock went stale); nothing of this run was published")
      self.content, self.generation = content, generation

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with contextlib.suppress(Exception):
        self._write()

  def set_state(self, state: str, **fields) -> None:
    """Records the run's state before it acts on it: "publishing" (DST is being replaced) with `staging`, the id
    of the staging prefix being published; "writing" again after completing a dead run's publication."""
    self._write(state=state, **fields)

  def keep(self) -> None:
    """Leaves the lock object in place at `release` (a half-published DST: the next run completes it)."""
    self.kept = True

  def release(self) -> None:
    self._stop.set()
    self._thread.join(timeout=HEARTBEAT_S)
    with self._lock, contextlib.suppress(Exception):
      if not self.lost and not self.kept:
        objects.delete(self.url, if_generation=self.generation)


def acquire(dst: str, run_id: str, *, url: str | None = None) -> Lock:
  """Takes the lock of `dst` for the run `run_id` (its object `url`, `lock_url(dst)` unless given), taking over a
  stale one.

  Raises:
    errors.InputError: a live run holds it.
  """
  url = url or lock_url(dst)
  content = {"id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "state": "writing",
             "heartbeat": time.time()}
  previous = None
  for _ in range(5):
    data, generation = objects.read(url)
    if data is not None:
      try:
        held = json.loads(data)
      except ValueError:
        held = {}
      if isinstance(held, dict) and not stale(held):
        raise errors.InputError(f"output {dst!r} is being written by another inspect_checkpoint run; wait for it "
                                "to finish or choose another path")
      previous = held if isinstance(held, dict) else {}
    created = objects.write(url, json.dumps(content).encode(), if_generation=generation)
    if created is not None:
      check, _ = objects.read(url)  # an emulator may ignore the condition: the object must hold our id
      if check is not None and json.loads(check).get("id") == run_id:
        return Lock(url, dst, content, created, previous)
  raise errors.InputError(f"output {dst!r} is being written by another inspect_checkpoint run; wait for it to "
                          "finish or choose another path")
