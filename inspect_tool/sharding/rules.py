"""Logical axis names → MaxText's `PartitionSpec` and per-device shard shape, on a `mesh.Mesh`.

The resolution is Flax's `logical_to_mesh_axes` followed by MaxText's `remove_size_one_mesh_axis`:
rules are tried in order; a rule applies to the dimension carrying its logical name when that dimension is still
unassigned and none of the rule's mesh axes is already used by another dimension (so a later duplicate rule,
e.g. MaxText's second `embed` rule, serves when the first collides). Names no rule assigns stay replicated.
Then every mesh axis of size 1 (or absent from the mesh) is dropped; an empty entry is `None`, a one-axis
entry is the bare name.

A dimension that the product of its mesh axes does not divide: MaxText builds the abstract model anyway, but
JAX refuses the sharding (`IndivisibleError`) as soon as an array is placed or a step compiled, so the run
fails. We refuse it too (`ShardingError`, exit 2), naming the parameter.

`effective_rules(cfg)` applies MaxText's merge: given rules replace every base rule of the same logical name
and are appended after the remaining base rules, unless `override_logical_axis_rules` is true.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from inspect_tool import errors
from inspect_tool.configuration import maxtext_keys
from inspect_tool.sharding import mesh as mesh_lib

Entry = str | tuple[str, ...] | None  # one dimension of a spec
_UNASSIGNED = object()


def _as_mesh_names(rule, value) -> str | tuple[str, ...]:
  """A rule's mesh axes: one name, or a list of distinct names (none or null: replicated)."""
  names = [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [] if value is None \
      else None
  if names is None or not all(isinstance(n, str) and n for n in names):
    raise mesh_lib.ShardingError(f"logical_axis_rules entry {errors.shown(rule)}: the mesh axes must be a mesh axis "
                                 "name or a list of them (e.g. [embed, [fsdp, expert]])")
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise mesh_lib.ShardingError(f"logical_axis_rules entry {errors.shown(rule)} names mesh axis {repeated[0]!r} "
                                 "twice; JAX refuses a sharding that uses one mesh axis twice (DuplicateSpecError)")
  return value if isinstance(value, str) else tuple(names)


def normalize_rules(rules) -> tuple[tuple[str, str | tuple[str, ...]], ...]:
  """`[[name, [axes...]], [name, axis], ...]` (YAML lists) → tuple pairs; `ShardingError` for another shape, an
  empty logical name, a mesh axis that is not a name or one named twice in a rule."""
  if rules is not None and not isinstance(rules, (list, tuple)):
    raise mesh_lib.ShardingError(f"logical_axis_rules={errors.shown(rules)} is not a list of "
                                 "[logical_name, mesh_axes] pairs")
  out = []
  for rule in rules or ():
    if not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], str):
      raise mesh_lib.ShardingError(f"logical_axis_rules entry {errors.shown(rule)} is not [logical_name, mesh_axes]")
    if not rule[0].strip():
      raise mesh_lib.ShardingError(f"logical_axis_rules entry {errors.shown(rule)} has an empty logical axis name")
    out.append((rule[0], _as_mesh_names(rule, rule[1])))
  return tuple(out)


@functools.lru_cache(maxsize=None)
def base_rules() -> tuple:
  """MaxText 0.2.5's `base.yml` logical_axis_rules."""
  return normalize_rules(maxtext_keys.defaults()["logical_axis_rules"])


def merge_rules(base: Sequence, new: Sequence) -> tuple:
  """MaxText's `_merge_logical_axis_rules`: drop base rules named in `new`, append `new`."""
  if not new:
    return tuple(base)
  names = {name for name, _ in new}
  return tuple(r for r in base if r[0] not in names) + tuple(new)


def effective_rules(cfg) -> tuple:
  rules = normalize_rules(cfg.logical_axis_rules)
  if bool(cfg.override_logical_axis_rules):
    return rules
  return merge_rules(base_rules(), rules)


def check_rule_axes(rules: Sequence, mesh: mesh_lib.Mesh) -> None:
  """Refuses a rule naming a mesh axis that `mesh_axes` does not have (MaxText would silently replicate it)."""
  known = set(mesh.axes)
  for name, axes in rules:
    for axis in (axes,) if isinstance(axes, str) else axes:
      if axis not in known:
        raise mesh_lib.ShardingError(f"logical_axis_rules: rule {name!r} names mesh axis {axis!r}, which "
                                     f"mesh_axes does not have; mesh axes: {', '.join(mesh.axes)}")


def _leaves(entry) -> set:
  if entry is None or entry is _UNASSIGNED:
    return set()
  return {entry} if isinstance(entry, str) else set(entry)


def logical_to_mesh(logical: Sequence[str | None], rules: Sequence) -> list:
  """Flax's priority resolution (before size-one removal): one entry per logical name."""
  named = [n for n in logical if isinstance(n, str)]
  dups = sorted({n for n in named if named.count(n) > 1})
  if dups:
    raise mesh_lib.ShardingError(f"logical axes {tuple(logical)} name {dups} more than once")
  result = [_UNASSIGNED if isinstance(n, str) else None for n in logical]
  for name, axes in rules:
    if name not in logical:
      continue
    pos = logical.index(name)
    used = set().union(*(_leaves(e) for e in result))
    if result[pos] is _UNASSIGNED and not used & _leaves(axes):
      result[pos] = axes
  return [None if e is _UNASSIGNED else e for e in result]


def drop_size_one(entries: Sequence, shape: dict[str, int]) -> tuple[Entry, ...]:
  """MaxText's `remove_size_one_mesh_axis` plus `PartitionSpec`'s canonical form."""
  out: list[Entry] = []
  for e in entries:
    if e is None:
      out.append(None)
      continue
    kept = tuple(a for a in ((e,) if isinstance(e, str) else e) if shape.get(a, 1) != 1)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return tuple(out)


def spec_for(logical: Sequence[str | None], rules: Sequence, mesh: mesh_lib.Mesh) -> tuple[Entry, ...]:
  return drop_size_one(logical_to_mesh(logical, rules), mesh.shape)


def entry_axes(entry: Entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shard_shape(shape: Sequence[int], spec: Sequence[Entry], mesh: mesh_lib.Mesh, key: str = "") -> tuple[int, ...]:
  """Per-device shape; `ShardingError` when a dimension is not divisible by its mesh axes' product."""
  sizes = mesh.shape
  out = []
  for dim, size in enumerate(shape):
    entry = spec[dim] if dim < len(spec) else None
    parts = math.prod(sizes.get(a, 1) for a in entry_axes(entry))
    if size % parts:
      raise mesh_lib.ShardingError(
          f"{key or 'array'} {tuple(shape)}: dimension {dim} ({size}) is not divisible by {parts} "
          f"({' × '.join(f'{a}={sizes[a]}' for a in entry_axes(entry))}); JAX refuses this sharding "
          "(IndivisibleError) when MaxText places or compiles it — choose parallelism values that divide it")
    out.append(size // parts)
  return tuple(out)


def format_spec(spec: Sequence[Entry]) -> str:
  """`P(('fsdp', 'expert'), None)` — MaxText's tuple spelling with a `P` in front."""
  return "P" + repr(tuple(spec))
