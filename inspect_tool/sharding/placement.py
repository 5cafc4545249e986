"""Every leaf of a model tree → MaxText's `PartitionSpec` and per-device shard shape on an abstract mesh.

Pure arithmetic over `tree.Leaf` records: no devices, no JAX mesh. See `logical_axes` (names), `rules`
(names → mesh axes) and `mesh` (axis sizes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from inspect_tool.paramtree import tree
from inspect_tool.sharding import logical_axes as axes_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class Placement:
  """One array's sharding: MaxText's spec entries (as MaxText prints them) and the per-device shape."""

  spec: tuple[rules_lib.Entry, ...]
  shard_shape: tuple[int, ...]

  @property
  def shard_size(self) -> int:
    return math.prod(self.shard_shape)

  def spec_text(self) -> str:
    return rules_lib.format_spec(self.spec)

  def spec_per_dim(self) -> list:
    """One item per dimension for JSON: null, an axis name, or a list of axis names."""
    entries = list(self.spec) + [None] * (len(self.shard_shape) - len(self.spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """The mesh and each leaf's placement, keyed by the leaf's dotted key."""

  mesh: mesh_lib.Mesh
  placements: Mapping[str, Placement]

  def of(self, leaf: tree.Leaf) -> Placement | None:
    return self.placements.get(leaf.dotted)

  def to_dict(self) -> dict:
    return {"devices": self.mesh.devices, "mesh": self.mesh.shape}


def plan(leaves, cfg, devices: int) -> ShardingPlan:
  """Shards `leaves` (a MaxText model's tree) as MaxText 0.2.5 does for `cfg` on `devices` devices.

  `mesh.ShardingError` (exit 2) for a mesh MaxText refuses, a rule naming an axis the mesh lacks, or a
  dimension its mesh axes do not divide.
  """
  if str(cfg.custom_mesh_and_rule):
    raise mesh_lib.ShardingError(f"custom_mesh_and_rule={cfg.custom_mesh_and_rule!r} is not modelled; accepted: "
                                 "'' (give mesh_axes and logical_axis_rules instead)")
  mesh = mesh_lib.build_mesh(cfg, devices)
  rules = rules_lib.effective_rules(cfg)
  if rules_lib.normalize_rules(cfg.logical_axis_rules) != rules_lib.base_rules():
    rules_lib.check_rule_axes(rules_lib.normalize_rules(cfg.logical_axis_rules), mesh)
  specs: dict = {}
  placements = {}
  for leaf in leaves:
    try:
      names = axes_lib.logical_axes(leaf, cfg)
    except axes_lib.UnknownVariable as e:
      raise mesh_lib.ShardingError(f"{leaf.dotted}: no MaxText logical axes known for {e.args[0]!r}") from None
    if names not in specs:
      specs[names] = rules_lib.spec_for(names, rules, mesh) if names else ()
    spec = specs[names]
    placements[leaf.dotted] = Placement(spec, rules_lib.shard_shape(leaf.shape, spec, mesh, leaf.dotted))
  return ShardingPlan(mesh, placements)
