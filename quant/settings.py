"""The MaxText config keys that shape Qwix rules, as a plain dataclass (no JAX import: cheap to load).

A model configuration that has these keys can inherit `QuantSettings` so the keys are declared once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# MaxText's `quantization` values whose Qwix rules `quant.rules` builds ("" = off).
QUANTIZATION_MODES = ("", "int4", "int8", "fp4", "fp4_e2m1", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_gpu", "fp8_nanoo",
                      "fp8_full")


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

  @classmethod
  def from_object(cls, obj: Any) -> "QuantSettings":
    """Reads the fields by name from any object that has (some of) them, e.g. a model config."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
    return cls(**values)
