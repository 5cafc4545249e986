"""Export stage 2, reading: the source arrays, from an Orbax checkpoint or the seeded random init.

Arrays are restored a group at a time (`read_group_bytes` of source bytes), each onto the mesh, and handed on one
by one; `LazyArrays` restores each array only when it is asked for (the Hugging Face writer's access pattern).
"""

from __future__ import annotations

from typing import Any, Iterator

from inspect_tool import errors
from inspect_tool import tree

READ_GROUP_BYTES = 64 * 1024 * 1024


def nbytes(leaf: tree.Leaf) -> int:
  """Bytes of a leaf's array (shape × dtype)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  return leaf.size * np.dtype(leaf.dtype).itemsize


def _groups(pairs, budget: int):
  group, size = [], 0
  for pair in pairs:
    if group and size + nbytes(pair.checkpoint) > budget:
      yield group
      group, size = [], 0
    group.append(pair)
    size += nbytes(pair.checkpoint)
  if group:
    yield group


def checkpoint_arrays(source: str, leaves, mesh, budget: int = READ_GROUP_BYTES) -> Iterator[tuple[tree.Leaf, Any]]:
  """(model leaf, jax.Array) for every model leaf, restored a group at a time onto `mesh`."""
  from inspect_tool.checkpoint import orbax_metadata, restore  # pylint: disable=import-outside-toplevel

  listing = orbax_metadata.read_listing(source)
  for group in _groups(restore.plan(listing, leaves), budget):
    arrays = restore.restore_pairs(listing, group, mesh=mesh)
    for pair in group:
      yield pair.model, arrays.pop(pair.model.key)


def init_arrays(cfg, leaves, mesh) -> Iterator[tuple[tree.Leaf, Any]]:
  """(model leaf, array) of the seeded random init (the whole model is built: for small models)."""
  import jax  # pylint: disable=import-outside-toplevel

  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool import params  # pylint: disable=import-outside-toplevel
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel

  from flax import nnx  # pylint: disable=import-outside-toplevel

  model = model_lib.build_model(cfg, abstract=False)
  values = {params.leaf_key(tuple(map(str, path)), variable): variable.get_value()
            for path, variable in nnx.to_flat_state(nnx.state(model))}
  del model
  for leaf in leaves:
    yield leaf, jax.device_put(values.pop(leaf.key), restore.array_sharding(leaf.shape, mesh))


def check_source(source: str) -> None:
  """Refuses a source that is itself an FP8 export."""
  from inspect_tool.fp8_export import load  # pylint: disable=import-outside-toplevel

  if load.find_report(source):
    raise errors.InputError(f"source {source!r} is already an FP8 export; export from the float checkpoint")


class LazyArrays:
  """Mapping leaf key -> array that restores each array from the checkpoint only when asked (one at a time)."""

  def __init__(self, source: str, leaves, mesh):
    from inspect_tool.checkpoint import orbax_metadata, restore  # pylint: disable=import-outside-toplevel

    self._listing = orbax_metadata.read_listing(source)
    self._pairs = {p.model.key: p for p in restore.plan(self._listing, leaves)}
    self._mesh = mesh

  def keys(self):
    return list(self._pairs)

  def __iter__(self):
    return iter(self._pairs)

  def __len__(self):
    return len(self._pairs)

  def __contains__(self, key):
    return key in self._pairs

  def __getitem__(self, key):
    from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel

    return restore.restore_pairs(self._listing, [self._pairs[key]], mesh=self._mesh)[key]
