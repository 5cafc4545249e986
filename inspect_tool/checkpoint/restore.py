"""Loads real weights from a MaxText-layout Orbax checkpoint into the NNX model, straight onto a device mesh.

Both MaxText layouts restore: the converter / params-only layout (every weight, the DeepSeek-V3 gate bias
included, under `items/params/params/...`) and the training layout (`params/params` plus
`nnx_aux/model/...` for the gate bias, next to `opt_state` and `step`, which are not read). Only the
arrays the model needs are requested, each placed with `array_sharding` on the mesh; a missing or
mis-shaped weight is a `MismatchError` before any array data is read.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.checkpoint import diff
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.storage import commit
from inspect_tool.storage import paths
from quant import errors as quant_errors

_TS_STATUS = re.compile(r"\b(DATA_LOSS|NOT_FOUND|FAILED_PRECONDITION|INVALID_ARGUMENT|OUT_OF_RANGE|UNKNOWN):")
_PARAM_IN_MESSAGE = re.compile(r'"([^"/]+)/(?:c/|\d)')


def default_mesh():
  """A one-axis mesh over every device (`('devices',)`)."""
  return jax.sharding.Mesh(np.array(jax.devices()), ("devices",))


def array_sharding(shape: tuple[int, ...], mesh):
  """Shards the largest dimension divisible by the mesh size over all mesh axes; replicates otherwise."""
  spec = jax.sharding.PartitionSpec()
  if mesh.size > 1:
    dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    dim = next((d for d in dims if shape[d] % mesh.size == 0), None)
    if dim is not None:
      parts = [None] * len(shape)
      parts[dim] = tuple(mesh.axis_names) if len(mesh.axis_names) > 1 else mesh.axis_names[0]
      spec = jax.sharding.PartitionSpec(*parts)
  return jax.sharding.NamedSharding(mesh, spec)


def _wanted(leaves: Iterable[tree.Leaf]) -> list[tree.Leaf]:
  """The model leaves that are weights to restore (RNG state is not)."""
  return [l for l in leaves if not (l.key[:2] == tree.AUX_PREFIX and "rngs" in l.key)]


def note_unused(where: str, names: list[str]) -> None:
  """One line on stderr naming the checkpoint arrays the model does not read (the first three and the count)."""
  if names:
    more = f", +{len(names) - 3} more" if len(names) > 3 else ""
    progress.note(f"note: {where} holds {len(names)} array(s) the model does not use: {', '.join(names[:3])}{more}")


def plan(listing: orbax_metadata.Listing, leaves: Iterable[tree.Leaf], *, report_unused: bool = False
         ) -> list[diff.Pair]:
  """Pairs each model leaf with the checkpoint leaf to read (gate-bias alias resolved).

  `report_unused`: say on stderr which checkpoint arrays no model leaf reads (`note_unused`).

  Raises:
    errors.MismatchError: a weight is missing or its shape or dtype differs.
  """
  result = diff.diff_leaves(_wanted(leaves), listing.leaves)
  if not result.loadable:
    summary = result.summary(unexpected=False)
    raise errors.MismatchError(f"checkpoint {listing.resolved.items_dir} does not fit the model: {summary}")
  if report_unused:
    note_unused(listing.resolved.items_dir, [l.dotted for l in result.unexpected])
  return result.matched


def _error_text(e: BaseException) -> tuple[str, bool]:
  """The most specific line of an exception chain, and whether it is a tensorstore storage status."""
  chain = quant_errors.exception_chain(e)
  for exc in chain:
    text = str(exc)
    if _TS_STATUS.search(text):
      return text.strip().splitlines()[0][:400], True
  lines = str(chain[-1]).strip().splitlines()
  return (lines[0] if lines else type(chain[-1]).__name__)[:400], False


def _read_error(items_dir: str, e: BaseException) -> errors.CheckpointError:
  text, storage = _error_text(e)
  if not storage:
    return errors.CheckpointError(f"{items_dir}: cannot restore arrays ({text})")
  match = _PARAM_IN_MESSAGE.search(text)
  what = f"the data of {match.group(1)}" if match else "array data"
  return errors.CheckpointError(
      f"{items_dir}: cannot read {what}: an array data file is missing, truncated or corrupt ({text})")


def restore_pairs(listing: orbax_metadata.Listing, pairs: list[diff.Pair], *, mesh=None,
                  shardings: Mapping[tuple[str, ...], object] | None = None) -> dict[tuple[str, ...], object]:
  """Reads the checkpoint arrays of `pairs` onto `mesh`; returns `{model leaf key: jax.Array}`."""
  # lazy: orbax.checkpoint, ~1 s to import: `diff` of an Orbax checkpoint loads this module without it
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  if not pairs:
    return {}
  mesh = mesh if mesh is not None else default_mesh()
  shardings = shardings or {}
  target: dict = {}
  for pair in pairs:
    raw = listing.raw_keys[pair.checkpoint.key]
    if any(isinstance(part, int) for part in raw):
      raise errors.CheckpointError(f"cannot restore {pair.checkpoint.dotted}: it is stored inside a list")
    node = target
    for part in raw[:-1]:
      node = node.setdefault(part, {})
    shape = pair.checkpoint.shape
    sharding = shardings.get(pair.model.key) or array_sharding(shape, mesh)
    node[raw[-1]] = jax.ShapeDtypeStruct(shape, jnp.dtype(pair.checkpoint.dtype), sharding=sharding)
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  items_dir = paths.absolute(listing.resolved.items_dir)
  args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
  try:
    own = listing.resolved.unpublished
    if own or (own is None and commit.own(items_dir)):  # this run's own gs:// output before its commit: Orbax's
      # handler reads it (its checkpointer refuses a step without Orbax's marker, written last)
      handler = ocp.PyTreeCheckpointHandler()
      try:
        restored = handler.restore(epath.Path(items_dir), args=args)
      finally:
        handler.close()
    else:
      with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(items_dir, args=args)
  except Exception as e:  # orbax/tensorstore raise bare Exception/ValueError with multi-line details
    raise _read_error(items_dir, e) from None
  arrays = {}
  for pair in pairs:
    node = restored
    for part in listing.raw_keys[pair.checkpoint.key]:
      node = node[part]
    arrays[pair.model.key] = node
  return arrays


def restore_leaves(path: str, leaves: Iterable[tree.Leaf], *, mesh=None,
                   shardings: Mapping[tuple[str, ...], object] | None = None,
                   report_unused: bool = False) -> dict[tuple[str, ...], object]:
  """Restores the checkpoint arrays for model `leaves` (keys as `param_leaves` gives them) onto `mesh`.

  Args:
    path: step directory, its `items` directory, or a directory of steps (latest taken).
    leaves: the model's leaves; the checkpoint may store a gate bias under either collection.
    mesh: a `jax.sharding.Mesh`; default: all devices on one axis.
    shardings: optional per-key `jax.sharding.Sharding` overriding `array_sharding`.

  Returns:
    `{leaf key: jax.Array}` for every leaf except RNG state.

  Raises:
    errors.CheckpointError: the path is not a readable checkpoint or array data is missing.
    errors.MismatchError: weights are missing or mis-shaped (names the first few, with the count).
  """
  listing = orbax_metadata.read_listing(path)
  return restore_pairs(listing, plan(listing, leaves, report_unused=report_unused), mesh=mesh, shardings=shardings)


def load_checkpoint(model, path: str | locate.ResolvedPath, *, mesh=None):
  """Loads every weight of `model` (an NNX model from `inspect_tool.model.build_model`) from `path`."""
  leaves = params.param_leaves(model, include_non_params=True)
  arrays = restore_leaves(path, leaves, mesh=mesh, report_unused=True)
  params.assign_arrays(model, arrays)
  return model
