"""Loads a Hugging Face DeepSeek checkpoint (bf16, or DeepSeek-V3's FP8 release layout) into the MaxText model.

The names are the exporter's (`hf_names.leaf_plan`: HF tensor(s) per MaxText leaf, MTP depth k as layer
`num_decoder_layers + k - 1`), read backwards: an (out, in) Linear weight becomes the MaxText kernel (in axes...,
out axes...), rope columns go back to MaxText's layout for `rope_interleave=false`, a layer stack is assembled
slice by slice. A float8 weight is dequantized as the release defines it: value × `weight_scale_inv` of its
128×128 block (the block grid rounded up at the edges). The MTP layers' copies of embed_tokens and
shared_head.head are accepted and not read (MaxText shares the main ones), and so is a zero
`e_score_correction_bias` the exporter adds for routing without `routed_bias`.

Tensor data is read from the shards at the offsets their validated headers give (safetensors 0.8's own numpy
reader has no float8 dtype); each array is built per device shard (`jax.make_array_from_callback`), reading only
the layers and experts that shard holds.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterable

import jax
import numpy as np

from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.checkpoint import files
from inspect_tool.hf import config as hf_config
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf import tensors as hf_tensors
from inspect_tool.checkpoint import restore
from inspect_tool.hf import safetensors_header
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.storage import web

CONFIG_NAME = hf_tensors.CONFIG_NAME
SCALE_SUFFIX = hf_tensors.SCALE_SUFFIX
scale_shape = hf_tensors.scale_shape


def is_hf_checkpoint(path: str | None) -> bool:
  """A directory with `config.json` and safetensors files (or their index): a Hugging Face checkpoint.

  Raises:
    errors.CheckpointError: safetensors files beside a `config.json` that is missing or not a regular file.
  """
  if not path or files.kind(path) != "dir":
    return False
  found = bool(files.list_suffix(path, ".safetensors") or files.list_suffix(path, safetensors_header.INDEX_SUFFIX))
  if not found and paths.is_web(path):
    raise web.not_found(path)  # over HTTP there is nothing else to read
  if not found:
    return False
  config = files.kind(os.path.join(path, CONFIG_NAME))
  if config == "missing":
    raise errors.CheckpointError(f"{os.path.join(path, CONFIG_NAME)} is missing: {path} holds safetensors files, "
                                 f"and a Hugging Face checkpoint needs its {CONFIG_NAME} (the model's keys)")
  if config != "file":
    raise errors.CheckpointError(f"{os.path.join(path, CONFIG_NAME)}: is not a regular file")
  return True


class Tensors(hf_tensors.Tensors):
  """`hf_tensors.Tensors`, knowing how the directory stores rope columns (`config.json`'s `rope_interleave`)."""

  def __init__(self, path: str):
    super().__init__(path)
    self.rope_interleaved = hf_config.stored_rope_interleaved(path)


# ---------------------------------------------------------------------------------------------------------
# What the checkpoint must hold for each leaf.

@dataclasses.dataclass(frozen=True)
class Problem:
  """An HF tensor that is missing, mis-shaped or not a float: what is wrong with it, for a leaf."""

  key: tuple[str, ...]
  name: str
  text: str
  shape: tuple[int, ...] | None = None  # the stored shape, when it is the shape that is wrong


def _layer_shape(entry) -> tuple[int, ...]:
  if entry.layer_axis is None:
    return entry.shape
  return entry.shape[:entry.layer_axis] + entry.shape[entry.layer_axis + 1:]


def _hf_shape(rule, shape: tuple[int, ...], cfg) -> tuple[int, ...] | None:
  """The HF tensor shape (values, not packed bytes) of one layer's MaxText slice (per expert for routed experts)."""
  v4 = hf_names_v4.hf_shape(rule, shape, cfg)
  if v4 is not None or rule.kind == hf_names_v4.ONES:
    return v4
  if rule.kind == hf_names.EXPERTS_FP8:
    shape = shape[1:]
  if rule.kind in (hf_names.FP8, hf_names.EXPERTS_FP8, hf_names.BF16_LINEAR):
    return (math.prod(shape[rule.n_in:]), math.prod(shape[:rule.n_in]))
  return shape


def _names(entry) -> list[str]:
  """The HF tensors read for a leaf: the first name of its rule per layer (and per expert)."""
  shape = _layer_shape(entry)
  names = []
  for layer in (entry.layers or (None,)) if entry.rule.names else ():
    name = entry.rule.names[0].replace("{i}", str(layer))
    if entry.rule.kind == hf_names.EXPERTS_FP8:
      names.extend(name.replace("{j}", str(j)) for j in range(shape[0]))
    else:
      names.append(name)
  return names


def _check_tensor(tensors: Tensors, key, name: str, want: tuple[int, ...], rule) -> Problem | None:
  if name not in tensors:
    return Problem(key, name, f"{name} is missing")
  kind, dtype = tensors.kind(name), tensors.dtype(name)
  expected = ("int",) if rule.kind == hf_names_v4.TABLE else ("float", "fp8", "fp4")
  if kind not in expected:
    what = "an integer tensor" if rule.kind == hf_names_v4.TABLE else "a floating-point or quantized tensor"
    return Problem(key, name, f"{name} is {dtype}, not {what}")
  shape = tensors.logical_shape(name)
  if shape != want:
    return Problem(key, name, f"{name} is {shape}, the model needs {want}", shape)
  if kind == "fp8":
    scale = tensors.scale_name(name)
    grid = scale_shape(want, tensors.block) if len(want) == 2 else None
    if scale is None:
      return Problem(key, name + SCALE_SUFFIX, f"{name} is {dtype} but its scale {name}{SCALE_SUFFIX} is missing")
    if tensors.shape(scale) != grid or tensors.kind(scale) == "fp4" or tensors.dtype(scale) not in (
        *hf_tensors.FLOATS, hf_tensors.E8M0):
      return Problem(key, scale, f"{scale} is {tensors.dtype(scale)} {tensors.shape(scale)}; {want} in "
                     f"{tensors.block[0]}x{tensors.block[1]} blocks needs float or e8m0 {grid}")
  return None


def check(tensors: Tensors, plan: dict, cfg) -> tuple[list[Problem], set[str]]:
  """Problems of every planned leaf, and every HF name the plan accounts for (copies and scales included)."""
  problems, known = [], set(hf_names.synthesized_names(cfg))
  for key, entry in plan.items():
    want = _hf_shape(entry.rule, _layer_shape(entry), cfg)
    for name in _names(entry):
      problem = _check_tensor(tensors, key, name, want, entry.rule)
      if problem is not None:
        problems.append(problem)
        break
    for layer in entry.layers or (None,):
      for pattern in entry.rule.names:
        name = pattern.replace("{i}", str(layer))
        experts = range(_layer_shape(entry)[0]) if "{j}" in name else (None,)
        known.update(name.replace("{j}", str(j)) for j in experts)
  known.update([scale for scale in map(tensors.scale_name, known & set(tensors.table)) if scale])
  return problems, known


# ---------------------------------------------------------------------------------------------------------
# Reading leaves.

def _layer_value(tensors: Tensors, entry, layer, index: tuple, cfg) -> np.ndarray:
  """One layer's MaxText slice, `index`ed (for routed experts only the experts `index[0]` selects are read)."""
  rule, shape = entry.rule, _layer_shape(entry)
  if rule.kind == hf_names_v4.ONES:
    return np.ones(shape, np.float32)[index]
  name = rule.names[0].replace("{i}", str(layer))
  if rule.kind == hf_names.EXPERTS_FP8:
    experts = range(shape[0])[index[0]]
    value = np.stack([hf_names.maxtext_kernel(tensors.read(name.replace("{j}", str(j))), rule, shape[1:], cfg,
                                              tensors.rope_interleaved)
                      for j in experts]) if len(experts) else np.zeros((0,) + shape[1:], np.float32)
    return value[(slice(None),) + index[1:]]
  value = tensors.read(name)
  if rule.kind in (hf_names.FP8, hf_names.BF16_LINEAR):
    value = hf_names.maxtext_kernel(value, rule, shape, cfg, tensors.rope_interleaved)
  elif hf_names_v4.hf_shape(rule, shape, cfg) is not None:
    value = hf_names_v4.to_maxtext(rule, value, shape, cfg)
  return value.reshape(shape)[index]


def read_block(tensors: Tensors, entry, index: tuple, cfg) -> np.ndarray:
  """The part `index` (a tuple of slices over the leaf's shape) of a MaxText leaf, as float32."""
  index = tuple(index) + (slice(None),) * (len(entry.shape) - len(index))
  if entry.layer_axis is None:
    return _layer_value(tensors, entry, entry.layers[0] if entry.layers else None, index, cfg)
  axis = entry.layer_axis
  rest = index[:axis] + index[axis + 1:]
  layers = entry.layers[index[axis]]
  parts = [_layer_value(tensors, entry, layer, rest, cfg) for layer in layers]
  return np.stack(parts, axis=axis)


def _wanted(leaves: Iterable[tree.Leaf]) -> list[tree.Leaf]:
  return [l for l in leaves if not (l.key[:2] == tree.AUX_PREFIX and "rngs" in l.key)]


def planned(leaves: Iterable[tree.Leaf], plan: dict) -> list[tuple[tree.Leaf, tuple[str, ...] | None]]:
  """(model leaf, its plan key or None) pairs; the gate bias may be planned under either collection."""
  pairs = []
  for leaf in leaves:
    aliases = (leaf.key, tree.aux_key(leaf.key[2:]), tree.param_key(leaf.key[2:]))
    pairs.append((leaf, next((k for k in aliases if k in plan), None)))
  return pairs


def restore_leaves(path: str, cfg, leaves: Iterable[tree.Leaf], *, mesh=None,
                   report_unused: bool = False) -> dict[tuple[str, ...], object]:
  """Reads the HF checkpoint at `path` as `{leaf key: jax.Array}` for the model `leaves` of `cfg`, on `mesh`.

  `report_unused`: say on stderr which tensors no model leaf reads.

  Raises:
    errors.CheckpointError: unreadable files or headers.
    errors.MismatchError: a tensor the model needs is missing or mis-shaped (checked before reading data).
  """

  tensors = Tensors(path)
  tensors.check_format()
  plan = hf_names_v4.plan(cfg, tensors.table)
  problems, known = check(tensors, plan, cfg)
  if problems:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise errors.MismatchError(f"Hugging Face checkpoint {path} does not fit the model: {problems[0].text}{more}")
  if report_unused:
    restore.note_unused(path, sorted(name for name in tensors.table if name not in known))
  mesh = mesh if mesh is not None else restore.default_mesh()
  arrays = {}
  for leaf, target in planned(_wanted(leaves), plan):
    if target is None:
      raise errors.MismatchError(f"model weight {leaf.dotted} has no Hugging Face DeepSeek tensor")
    entry = plan[target]
    if tuple(leaf.shape) != entry.shape:
      raise errors.MismatchError(f"model weight {leaf.dotted} is {leaf.shape}; the plan has {entry.shape}")
    dtype = np.dtype(leaf.dtype)
    arrays[leaf.key] = jax.make_array_from_callback(
        entry.shape, restore.array_sharding(entry.shape, mesh),
        lambda index, entry=entry, dtype=dtype: read_block(tensors, entry, index, cfg).astype(dtype))
  return arrays


def load_checkpoint(model, path: str, *, mesh=None):
  """Loads every weight of the NNX `model` (its `config` says which names) from the HF checkpoint `path`; what the
  directory's model computes that MaxText does not (DeepSeek-V4's YaRN) is named on stderr."""
  hf_config.check_keys(model.config, path)
  for text in hf_config.differences(path):
    progress.note(f"warning: {path} computes what MaxText does not: {text}")
  leaves = params.param_leaves(model, include_non_params=True)
  params.assign_arrays(model, restore_leaves(path, model.config, leaves, mesh=mesh, report_unused=True))
  return model
