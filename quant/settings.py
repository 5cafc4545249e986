"""The MaxText config keys that shape Qwix rules, as a plain dataclass (no JAX import: cheap to load).

A model configuration that has these keys can inherit `QuantSettings` so the keys are declared once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quant import errors

# `gmm_backend` values (`quant.gmm.backends` runs them; kept here so that config parsing needs no JAX).
GMM_BACKENDS = ("auto", "reference", "pallas", "megablox", "xla", "tokamax")

# MaxText's `quantization` values whose Qwix rules `quant.rules` builds ("" = off).
QUANTIZATION_MODES = ("", "int4", "int8", "fp4", "fp4_e2m1", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_gpu", "fp8_nanoo",
                      "fp8_full")


class _Checked:
  """A dataclass field whose value is checked when set (also in subclasses that define their own __post_init__)."""

  def __init__(self, default, accepted: tuple):
    self._default, self._accepted = default, accepted

  def __set_name__(self, owner, name):
    self._name = name

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self._default
    return obj.__dict__.get(self._name, self._default)

  def __set__(self, obj, value):
    if value not in self._accepted:
      raise errors.QuantError(f"{self._name}={value!r}; accepted: {', '.join(repr(a) for a in self._accepted)}")
    obj.__dict__[self._name] = value


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSettings:
  """The MaxText config keys that shape the Qwix rules (same names and defaults as MaxText's base.yml)."""

  quantization: str = ""
  use_qwix_quantization: bool = False  # accepted for MaxText command lines; rules are always Qwix rules here
  quantize_mtp: bool = False
  quantize_router_proj: bool = True
  quantize_logits_proj: bool = False
  logits_proj_quant_calibration_method: str = ""
  weight_quantization_calibration_method: str = "absmax"
  act_quantization_calibration_method: str = "absmax"
  bwd_quantization_calibration_method: str = "absmax"
  drhs_grad_quantization_calibration_method: str | None = None
  quantization_local_shard_count: int = -1  # -1: number of slices, 1 on one host
  weight_sparsity_n: int | None = None
  weight_sparsity_m: int | None = None
  weight_sparsity_start_step: int = 50
  weight_sparsity_update_step: int = 10
  # The grouped matmul of the routed experts (with megablox=true): which kernel runs it (`quant.gmm.backends`).
  gmm_backend: str = _Checked("auto", GMM_BACKENDS)  # auto: our Pallas kernel on TPU, ragged_dot on GPU, tiled on CPU
  use_tokamax_backend: bool = False  # MaxText's key: Tokamax's kernel (gmm_backend must then be auto or tokamax)

  @classmethod
  def from_object(cls, obj: Any) -> "QuantSettings":
    """Reads the fields by name from any object that has (some of) them, e.g. a model config."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
    return cls(**values)
