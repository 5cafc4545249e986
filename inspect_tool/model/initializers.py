"""How the model's variables come into being: shapes only (abstract) or random values, single or stacked.

Every module receives a `VariableFactory` and asks it for its variables by per-layer shape. The factory
decides what the variable holds:
  * abstract (no seed): a `jax.ShapeDtypeStruct` — nothing is allocated and nothing is traced, which keeps
    `inspect_checkpoint maxtext model_name=deepseek3-671b` fast;
  * real (a seed): values drawn with NumPy from MaxText's initializer families (`dense`, `normal`, `ones`,
    `zeros`; not bitwise MaxText's draws), then put on the default device. NumPy keeps a random init free
    of XLA compilation (a jitted init of even the tiny model compiles for many seconds);
and, for a scanned stack of N layers (`stacked(N)`), stacks them the way MaxText's `create_scanned_layers`
does: `nnx.Param` arrays get the layer axis at `param_scan_axis`, every other variable (the DeepSeek-V3
gate bias `MoEBiasVar`) at axis 0.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]  # float32 values
TRUNCATED_NORMAL_STDDEV = 0.87962566103423978  # stddev of a standard normal truncated to [-2, 2]


def ones(rng, shape):
  del rng
  return np.ones(shape, np.float32)


def zeros(rng, shape):
  del rng
  return np.zeros(shape, np.float32)


def _truncated_standard_normal(rng: np.random.Generator, shape) -> np.ndarray:
  values = rng.standard_normal(shape, dtype=np.float32)
  outside = np.abs(values) > 2
  while outside.any():
    values[outside] = rng.standard_normal(int(outside.sum()), dtype=np.float32)
    outside = np.abs(values) > 2
  return values


def normal(stddev: float) -> Init:
  def init(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(stddev)
  return init


def dense(in_axes: Sequence[int], distribution: str = "truncated_normal") -> Init:
  """MaxText's `nd_dense_init(1.0, "fan_in", distribution)`: variance 1/fan_in over the contracted axes."""
  def init(rng, shape):
    std = 1.0 / math.sqrt(math.prod(shape[a] for a in in_axes))
    if distribution == "truncated_normal":
      return _truncated_standard_normal(rng, shape) * np.float32(std / TRUNCATED_NORMAL_STDDEV)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
  return init


def layer_axis(per_layer_ndim: int, axis: int) -> int:
  """Where the layer axis of a stacked variable goes (MaxText moves it only where the stacked rank allows)."""
  return axis if per_layer_ndim >= axis else 0


class VariableFactory:
  """Creates variables for modules; see the module docstring."""

  def __init__(self, *, weight_dtype, param_scan_axis: int = 1, seed: int | None = None, layers: int = 0,
               _rng: np.random.Generator | None = None):
    self.weight_dtype = jnp.dtype(weight_dtype)
    self.param_scan_axis = param_scan_axis
    self.layers = layers
    self._rng = _rng if _rng is not None or seed is None else np.random.default_rng(seed)

  @property
  def abstract(self) -> bool:
    return self._rng is None

  def stacked(self, layers: int) -> "VariableFactory":
    """A factory for a scanned stack of `layers` layers, drawing from this factory's random stream."""
    return VariableFactory(weight_dtype=self.weight_dtype, param_scan_axis=self.param_scan_axis, layers=layers,
                           _rng=self._rng)

  def make(self, shape: Sequence[int], init: Init, *, kind: type = nnx.Param, dtype=None) -> nnx.Variable:
    """A variable of per-layer `shape` (stacked when this factory is for a scanned stack)."""
    shape = tuple(int(d) for d in shape)
    dtype = jnp.dtype(dtype) if dtype is not None else self.weight_dtype
    axis = layer_axis(len(shape), self.param_scan_axis if issubclass(kind, nnx.Param) else 0)
    if self.abstract:
      full = shape[:axis] + (self.layers,) + shape[axis:] if self.layers else shape
      return kind(jax.ShapeDtypeStruct(full, dtype))
    if self.layers:
      values = np.stack([init(self._rng, shape) for _ in range(self.layers)], axis=axis)
    else:
      values = init(self._rng, shape)
    return kind(jnp.asarray(values.astype(dtype)))
