"""Process-wide state, declared in one place: what each piece holds now, and the end of a command that empties it.

A module that keeps state from one call to the next keeps it where it is used and declares it here once, when it is
imported, with a function that shows what it holds (empty or default: falsy) and one that empties it. Three kinds:

* `RUN`: belongs to the command that made it (a destination claimed on gs://, a stop signal received, a distributed
  job planned) and is empty again when that command has ended; `end_command` does not touch it, so a command that
  leaves some behind shows up in `leftovers`;
* `SETTING`: a command-line flag made process-wide for the command's length (`--quiet`, the compilation cache, the
  memory budget's hand-back mark): back to its default at `end_command`;
* `CACHE`: bytes or decoded records kept for the next read (HTTP answers, B-tree nodes): dropped at `end_command`,
  so the next command in the same process reads afresh.

`cli.main` ends every in-process command with `end_command`; `tests/test_process_state.py` runs the commands one
after another in one process and checks `leftovers()` after each, and that every module-level container or
`global` of the tool is declared here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

RUN, SETTING, CACHE = "run", "setting", "cache"


@dataclasses.dataclass(frozen=True)
class Declared:
  """One piece of process-wide state: `module:name(s)`, its kind, what it holds now, how it is emptied."""
  name: str
  kind: str
  held: Callable[[], object]
  reset: Callable[[], None] | None


_declared: dict[str, Declared] = {}  # the registry itself: filled as modules are imported, never emptied


def declare(name: str, kind: str, held: Callable[[], object], reset: Callable[[], None] | None = None) -> None:
  """Declares the state `name` ("module:attribute", several attributes joined by ","); SETTING and CACHE need
  `reset`."""
  if kind not in (RUN, SETTING, CACHE) or (kind != RUN and reset is None):
    raise ValueError(f"process state {name}: kind {kind!r} with reset {reset!r}")
  _declared[name] = Declared(name, kind, held, reset)


def declared() -> tuple[Declared, ...]:
  return tuple(_declared.values())


def leftovers() -> dict[str, object]:
  """Every declared piece that holds something now, by name."""
  return {d.name: held for d in _declared.values() if (held := d.held())}


def end_command() -> None:
  """The end of a command in this process: settings back to their defaults, caches dropped (run state is the
  command's own to empty: what it left is in `leftovers`)."""
  for d in _declared.values():
    if d.kind != RUN:
      d.reset()
