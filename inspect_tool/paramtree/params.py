"""Model variables ↔ `tree.Leaf` records, and loading arrays into a model by leaf key.

Keys follow MaxText's on-disk convention: `('params', 'params', *path)` for `nnx.Param` and
`('nnx_aux', 'model', *path)` for other persistent state (the DeepSeek-V3 `MoEBiasVar` gate bias).
RNG state and intermediates are never listed. `assign_arrays` also accepts a non-Param variable under
the `params/params` alias (MaxText's converter layout keeps the gate bias there).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from flax import nnx
import jax.numpy as jnp
import numpy as np

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.paramtree import tree


def _variables(model):
  """(path tuple of str, variable) for every persistent variable, in NNX's sorted order."""
  for path, variable in nnx.to_flat_state(nnx.state(model)):
    if isinstance(variable, (nnx.RngState, nnx.Intermediate)):
      continue
    yield tuple(str(p) for p in path), variable


def _is_param(variable) -> bool:
  return isinstance(variable, nnx.Param)


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def leaf_key(path: tuple[str, ...], variable) -> tuple[str, ...]:
  return tree.param_key(path) if _is_param(variable) else tree.aux_key(path)


def param_leaves(model, *, include_non_params: bool = False) -> list[tree.Leaf]:
  """One `Leaf` per variable of `model` (real or abstract); non-Params only with `include_non_params`."""
  leaves = []
  for path, variable in _variables(model):
    if not include_non_params and not _is_param(variable):
      continue
    value = variable.get_value()
    leaves.append(tree.Leaf(leaf_key(path, variable), tuple(int(d) for d in value.shape),
                            _dtype_name(value.dtype)))
  return leaves


def assign_arrays(model, arrays: Mapping[tuple[str, ...], Any]) -> list[tuple[str, ...]]:
  """Writes `arrays` (Leaf key → array) into `model`'s variables, cast to each variable's dtype.

  Every variable must be supplied with its exact shape; otherwise nothing is written and
  `errors.MismatchError` names every missing and mis-shaped weight. Returns the keys of `arrays` that
  no variable used (RNG state, optimizer state, ...), sorted.
  """
  plan, missing, misshaped, used = [], [], [], set()
  for path, variable in _variables(model):
    key = leaf_key(path, variable)
    if key not in arrays and not _is_param(variable) and tree.param_key(path) in arrays:
      key = tree.param_key(path)  # converter layout: gate bias under params/params
    if key not in arrays:
      missing.append(".".join(key))
      continue
    used.add(key)
    value, expected = arrays[key], variable.get_value()
    if tuple(value.shape) != tuple(expected.shape):
      misshaped.append(f"{'.'.join(key)} {tuple(value.shape)} (model: {tuple(expected.shape)})")
      continue
    plan.append((variable, value, expected.dtype))
  if missing or misshaped:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)}: {', '.join(missing)}")
    if misshaped:
      parts.append(f"mis-shaped {len(misshaped)}: {', '.join(misshaped)}")
    raise errors.MismatchError("weights do not fit the model; " + "; ".join(parts))
  for variable, value, dtype in plan:
    variable.set_value(jnp.asarray(value, dtype))
  return sorted((k for k in arrays if k not in used), key=lambda k: tree.natural_key(".".join(k)))


def replace_values(model, replace: Callable[[tuple[str, ...], Any], Any]) -> int:
  """Sets every variable of `model` for which `replace(leaf key, value)` is not None to that array (in the
  variable's dtype); returns how many were replaced."""
  count = 0
  for path, variable in _variables(model):
    value = variable.get_value()
    new = replace(leaf_key(path, variable), value)
    if new is not None:
      variable.set_value(jnp.asarray(new, value.dtype))
      count += 1
  return count


def model_leaves(cfg) -> list[tree.Leaf]:
  """Every leaf of the config's (float) model, built abstractly: Params and non-Param state, as a checkpoint stores
  them."""
  return param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)


def parameter_count(cfg) -> int:
  """The parameters (Params only) of the config's model, counted on the abstract model (no memory)."""
  return sum(math.prod(leaf.shape) for leaf in param_leaves(model_lib.build_model(cfg, abstract=True)))
