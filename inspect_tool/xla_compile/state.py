"""What a compiled step takes, abstractly, with MaxText's shardings on the topology's devices.

The model is built abstractly (no weights); each variable gets the `PartitionSpec` the sharding plan gives it
(`sharding.placement`, MaxText's logical axis rules), the optimizer state its parameter's, and the batch
MaxText's input sharding (`input_data_sharding_logical_axes`). The batch is MaxText's shaped batch: `inputs`,
`inputs_position`, `inputs_segmentation`, `targets`, `targets_position`, `targets_segmentation`, int32
[per_device_batch_size × devices, max_target_length].
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from inspect_tool import errors
from inspect_tool.model import partitioning
from inspect_tool.paramtree import params as params_lib
from inspect_tool.sharding import placement
from inspect_tool.sharding import rules as rules_lib

BATCH_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position",
              "targets_segmentation")


def device_mesh(plan: placement.ShardingPlan, devices: list) -> Mesh:
  """The JAX mesh of `plan`'s axes over `devices` (their physical layout followed, as MaxText's mesh does)."""
  try:
    grid = mesh_utils.create_device_mesh(plan.mesh.sizes, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    grid = mesh_utils.create_device_mesh(plan.mesh.sizes, devices, contiguous_submeshes=False,
                                         allow_split_physical_axes=True)
  return Mesh(grid, plan.mesh.axes)


def activation_partitioning(cfg, plan: placement.ShardingPlan, mesh: Mesh, platform: str = "tpu"):
  """`partitioning.Partitioning` with MaxText's logical rules on `mesh` (activation names → specs)."""
  rules = rules_lib.effective_rules(cfg)
  cache: dict = {}

  def spec(names):
    if names not in cache:
      cache[names] = PartitionSpec(*rules_lib.spec_for(names, rules, plan.mesh))
    return cache[names]

  return partitioning.Partitioning(mesh, spec, platform)


def _shardings(state, plan: placement.ShardingPlan, mesh: Mesh):
  """A `NamedSharding` per variable of an NNX `state`, from the plan's placement of that variable."""
  flat = []
  for path, variable in nnx.to_flat_state(state):
    key = ".".join(params_lib.leaf_key(tuple(str(p) for p in path), variable))
    where = plan.placements.get(key)
    spec = PartitionSpec(*where.spec) if where is not None else PartitionSpec()
    flat.append((path, variable.replace(NamedSharding(mesh, spec))))
  return nnx.from_flat_state(flat)


@dataclasses.dataclass
class Abstract:
  """A model's abstract parameters and other state, the batch, and their shardings."""

  graphdef: object
  params: object
  rest: object
  params_sharding: object
  rest_sharding: object
  batch: dict
  batch_sharding: dict
  mesh: Mesh


def abstract(model, cfg, plan: placement.ShardingPlan, mesh: Mesh) -> Abstract:
  """`model` (built abstractly) split into Params and the rest, each sharded as `plan` says; MaxText's batch."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rows = int(round(float(cfg.per_device_batch_size) * plan.mesh.devices))
  if rows < 1:
    raise errors.ConfigError(f"per_device_batch_size={cfg.per_device_batch_size} on {plan.mesh.devices} devices is "
                             "less than one sequence in all; give a batch of at least one sequence")
  batch_spec = PartitionSpec(*rules_lib.spec_for(tuple(cfg.input_data_sharding_logical_axes),
                                                 rules_lib.effective_rules(cfg), plan.mesh))
  batch = {k: jax.ShapeDtypeStruct((rows, int(cfg.max_target_length)), jnp.int32) for k in BATCH_KEYS}
  return Abstract(graphdef, params, rest, _shardings(params, plan, mesh), _shardings(rest, plan, mesh), batch,
                  {k: NamedSharding(mesh, batch_spec) for k in BATCH_KEYS}, mesh)


def optimizer_sharding(opt_state, params, params_sharding, mesh: Mesh):
  """Each optimizer leaf sharded like its parameter (mu, nu); the rest (the step count) replicated."""
  structure = jax.tree.structure(params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def walk(node):
    if jax.tree.structure(node) == structure:
      return params_sharding
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(**{f: walk(getattr(node, f)) for f in node._fields})
    if isinstance(node, (tuple, list)):
      return type(node)(walk(n) for n in node)
    return jax.tree.map(lambda _: replicated, node)

  return walk(opt_state)
