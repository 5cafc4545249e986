"""What marks an output as this tool's: the partial marker of its work directories, the producer name its reports
carry, the record of a claimed destination (`destination.claim`, `object_store.claim`), and whether the process
that left a temporary or a lock is still alive."""

from __future__ import annotations

import dataclasses
from importlib import metadata
import os

from inspect_tool.storage import paths

TMP_MARKER = ".inspect_checkpoint-partial"  # written first into every temporary output directory
PRODUCER = "inspect_checkpoint"


def names_producer(doc, field: str) -> bool:
  """True when the JSON document `doc` names this tool as producer under `field`."""
  value = doc.get(field) if isinstance(doc, dict) else None
  if isinstance(value, dict):
    value = value.get("producer", value.get("name"))
    if isinstance(value, dict):
      value = value.get("name")
  return isinstance(value, str) and value.startswith(PRODUCER)


@dataclasses.dataclass
class Claim:
  """A locked destination: `path` (absolute), `parent`; `reclaimed` lists the stale temporaries removed."""

  path: str
  overwrite: bool
  reclaimed: list

  @property
  def parent(self) -> str:
    return paths.parent(self.path)


def alive(pid: int) -> bool:
  """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def producer() -> dict:
  """The producer record every report carries: this tool's name and installed version."""
  try:
    version = metadata.version("inspect-checkpoint")
  except metadata.PackageNotFoundError:
    version = "unknown"
  return {"name": PRODUCER, "version": version}
