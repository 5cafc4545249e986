"""Float source checkpoints saved by Orbax itself (OCDBT + zarr3, as MaxText saves), so that their chunking is
exactly Orbax's: one chunk per array (a default save on local disk: Orbax caps chunks only at its 2 GiB OCDBT
target file size) or chunks of at most `chunk_byte_size` bytes (`SaveArgs(chunk_byte_size=...)`, what a save to
GCS gets at 400 MiB), chosen by Orbax's `subchunking.choose_chunk_shape` (it halves the largest axis first)."""

from __future__ import annotations

import math
import os

import numpy as np

from inspect_tool.configuration import config
from inspect_tool.paramtree import tree
from inspect_tool.paramtree import params


def write_source(step_dir: str, tokens: list[str], *, chunk_byte_size: int | None = None, seed: int = 0,
                 bf16_values: bool = False) -> dict:
  """Saves the float model of `tokens` (seeded normal values; norms ones, biases zeros) with Orbax at
  `step_dir/items` (converter layout: everything under params/params); with `bf16_values`, float32 values that are
  bfloat16 numbers (what MaxText's converter writes from bf16 weights: zstd stores them in about half their
  bytes). Returns {dotted key: chunk shape}."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(seed)
  values, args = {}, {}
  for leaf in params.model_leaves(config.resolve_config(tokens)):
    shape = tuple(leaf.shape)
    if leaf.key[-1] == "scale":
      value = np.ones(shape, np.float32)
    elif leaf.key[-1] == "bias":
      value = np.zeros(shape, np.float32)
    else:
      value = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(shape[0] if shape else 1))
      if bf16_values:
        value = (value.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    node, save = values, args
    key = tree.param_key(leaf.module_path)
    for part in key[:-1]:
      node, save = node.setdefault(part, {}), save.setdefault(part, {})
    node[key[-1]] = jax.numpy.asarray(value)
    save[key[-1]] = ocp.SaveArgs(chunk_byte_size=chunk_byte_size)
  items = os.path.join(step_dir, "items")
  os.makedirs(step_dir, exist_ok=True)
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(items, args=ocp.args.PyTreeSave(values, save_args=args))
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{items}/"}).result()
  names = sorted({k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
  chunks = {}
  for name in names:
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/",
                                                    "path": name + "/"}}, open=True).result()
    chunks[name] = tuple(int(d) for d in store.chunk_layout.read_chunk.shape)
  return chunks


def restore_numpy(items_dir) -> dict:
  """Every array of an Orbax item directory as numpy, on any host: Orbax restores a checkpoint saved on one platform
  onto another (a CPU-written checkpoint on a TPU host) only with a target, here numpy for every leaf."""
  import jax  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  items_dir = os.path.abspath(str(items_dir))
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree_metadata = handler.metadata(epath.Path(items_dir)).tree
  finally:
    handler.close()
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree_metadata)
  with ocp.PyTreeCheckpointer() as checkpointer:
    return checkpointer.restore(items_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
