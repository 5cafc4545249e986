"""`--collapse`: repeated layers and experts as one line per stack.

An index in a key is a number of its own (`model.layers.3.mlp.experts.17.gate_proj.weight`, `opt_state.0`) or the
number of a MaxText layer (`dense_layers_0`, `moe_layers_12`, V4's `layers_5`). Indices are folded innermost
first: leaves that differ only in that index, with the same shape, dtype (and whatever else `signature` adds, e.g.
the sharding) and the same folded inner part, become one `Stack` whose index set prints as a range
(`experts.{0..255}`, `moe_layers_{0..57}`, V4's alternating `layers_{2..42 step 2}`); then the next index outwards, so
a DeepSeek-V3 safetensors directory's per-expert tensors become one line per projection and layer range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import re
from typing import Callable, Sequence

from inspect_tool.paramtree import tree

_LAYER_INDEX = re.compile(r"^((?:.*_)?layers_)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stack:
  """Leaves that one collapsed line stands for: `key` with index ranges, every member of the same shape/dtype."""

  key: str
  members: tuple[tree.Leaf, ...]

  @property
  def first(self) -> tree.Leaf:
    return self.members[0]

  @property
  def count(self) -> int:
    return len(self.members)

  @property
  def size(self) -> int:
    return sum(leaf.size for leaf in self.members)


@functools.lru_cache(maxsize=1 << 16)
def _split(segment: str) -> tuple[str, int] | None:
  """(prefix, index) of an index segment: `'17'` -> ('', 17), `'moe_layers_3'` -> ('moe_layers_', 3)."""
  if segment.isdigit():
    return "", int(segment)
  match = _LAYER_INDEX.match(segment)
  return (match[1], int(match[2])) if match else None


def ranges(values: Sequence[int]) -> str:
  """`{0..255}`, `{1,4}`, `{2..42 step 2}`: sorted values as runs (three or more) of one step, and single values."""
  values = sorted(set(values))
  parts, i = [], 0
  while i < len(values):
    j = i
    if i + 1 < len(values):
      step, j = values[i + 1] - values[i], i + 1
      while j + 1 < len(values) and values[j + 1] - values[j] == step:
        j += 1
    if j - i >= 2:  # a run of three or more
      parts.append(f"{values[i]}..{values[j]}" + (f" step {step}" if step != 1 else ""))
      i = j + 1
    else:
      parts.append(str(values[i]))
      i += 1
  return "{" + ",".join(parts) + "}"


@contextlib.contextmanager
def _no_gc_pauses():
  """The fold allocates ~10 small containers per leaf: the cyclic collector would rescan them all, many times over
  (4x the work on 90,000 leaves); nothing here makes cycles, so it is paused meanwhile."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def collapse(leaves: Sequence[tree.Leaf], signature: Callable[[tree.Leaf], object] = lambda leaf: None) -> list[Stack]:
  """Stacks of `leaves` in their order (a stack where its first member was); lone leaves stay stacks of one."""
  with _no_gc_pauses():
    return _collapse(leaves, signature)


def _collapse(leaves, signature) -> list[Stack]:
  # A record: (segments, open index positions, members). Segments hold str, or (prefix, [values]) at an index.
  records = []
  for leaf in leaves:
    segments, open_at = [], []
    for position, segment in enumerate(leaf.key):
      split = _split(segment)
      if split is None:
        segments.append(segment)
      else:
        segments.append((split[0], (split[1],)))
        open_at.append(position)
    records.append((segments, open_at, [leaf]))
  while any(open_at for _, open_at, _ in records):
    groups: dict = {}
    order = []
    for segments, open_at, members in records:
      if not open_at:
        group_key = ("closed", id(members))
      else:
        at = open_at[-1]
        frozen = tuple(s if i != at else (s[0], None) for i, s in enumerate(segments))
        first = members[0]
        group_key = (frozen, at, first.shape, first.dtype, len(members), signature(first))
      if group_key not in groups:
        groups[group_key] = []
        order.append(group_key)
      groups[group_key].append((segments, open_at, members))
    records = []
    for group_key in order:
      group = groups[group_key]
      segments, open_at, _ = group[0]
      if open_at:
        at = open_at[-1]
        values = tuple(v for seg, _, _ in group for v in seg[at][1])
        segments = list(segments)
        segments[at] = (segments[at][0], values)
        open_at = open_at[:-1]
      records.append((segments, open_at, [leaf for _, _, members in group for leaf in members]))
  return [Stack(".".join(_text(s) for s in segments), tuple(members)) for segments, _, members in records]


def _text(segment) -> str:
  if isinstance(segment, str):
    return segment
  prefix, values = segment
  return f"{prefix}{values[0]}" if len(values) == 1 else prefix + ranges(values)
