"""Qwix rule sets: MaxText's rule builders for each `quantization` mode, and user rule files (YAML).

Every rule is a real `qwix.QtRule`, so the same list drives both the coverage trace and a quantized
forward pass. Settings come as a plain `QuantSettings` (field names are MaxText's config keys); this module
knows nothing about any model configuration class.

MaxText 0.2.5 (`layers/quantizations.py`) builds, first match wins:
  * `fp8_full`: [router all-None rule if not quantize_router_proj] + [logits rule if quantize_logits_proj]
    + main rule over `decoder/.*layers.*` (or `(decoder/.*layers.*|mtp_block/.*)` with quantize_mtp) for
    ops dot_general, gmm and ragged_dot, e4m3 forward / e5m2 backward.
  * `int4|int8|fp4|fp4_e2m1|fp8|fp8_e4m3|fp8_e5m2|fp8_gpu|fp8_nanoo`: [router rule?] + one dot_general rule
    over `decoder/.*layers.*` with the same qtype forward and backward and a backward weight-gradient tile of
    1/quantization_local_shard_count. Routed experts (gmm/ragged_dot) are never quantized in these modes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import qwix

from quant import compat
from quant import errors
from quant import safe_regex
from quant import settings
from quant import yaml_file

DECODER_LAYERS_PATH = "decoder/.*layers.*"
DECODER_AND_MTP_PATH = "(decoder/.*layers.*|mtp_block/.*)"
ROUTER_PATH = r".*/gate$"
LOGITS_PATH = "decoder/logits_dense.*"
FP8_FULL_OPS = ("dot_general", "gmm", "ragged_dot")

# quantization mode -> qtype of the single-rule modes (MaxText's `make_qt_rule(dtype)`).
_SINGLE_RULE_QTYPES = {
    "int4": jnp.int4,
    "int8": jnp.int8,
    "fp4": jnp.float4_e2m1fn,
    "fp4_e2m1": jnp.float4_e2m1fn,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "fp8_gpu": jnp.float8_e4m3fn,
    "fp8_nanoo": jnp.float8_e4m3fn,
}
QUANTIZATION_MODES = settings.QUANTIZATION_MODES
QuantSettings = settings.QuantSettings
# Which Qwix provider MaxText uses per mode; "qt" is `qwix.QtProvider`. The two vendor providers quantize
# every op whose rule is not None (they ignore weight_qtype); `QtProvider` needs rule.weight_qtype.
PROVIDERS = {mode: "qt" for mode in QUANTIZATION_MODES if mode}
PROVIDERS.update(fp8_gpu="nvidia_fp8", fp8_nanoo="nanoo_fp8")

# Qtypes a rule file may name: jnp dtypes (by name) and Qwix's synthetic string qtypes.
DTYPE_QTYPES = ("int8", "int4", "int2", "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float4_e2m1fn")
STRING_QTYPES = ("int3", "int5", "int6", "int7", "nf4", "mxfp8", "mxfp4", "nvfp4")
ACCEPTED_QTYPES = DTYPE_QTYPES + STRING_QTYPES
CALIBRATION_METHODS = ("absmax", "minmax", "rms", "fixed")
STOCHASTIC_ROUNDING = ("uniform", "low_bit_uniform")
_QTYPE_FIELDS = ("weight_qtype", "act_qtype", "bwd_qtype")


def provider_name(quantization: str) -> str | None:
  """The Qwix provider MaxText uses for a mode: 'qt', 'nvidia_fp8', 'nanoo_fp8', or None (no quantization)."""
  _check_mode(quantization)
  return PROVIDERS.get(quantization)


def quantizes(rule: qwix.QtRule | None, op_name: str, provider: str | None = "qt") -> bool:
  """Whether an op that matched `rule` runs quantized under `provider` (MaxText's provider semantics)."""
  if rule is None:
    return False
  if provider == "nvidia_fp8" and op_name in ("dot_general", "einsum"):
    return True
  if provider == "nanoo_fp8" and op_name == "dot_general":
    return True
  return rule.weight_qtype is not None


def build_rules(settings: QuantSettings | None = None, **keys: Any) -> list[qwix.QtRule]:
  """MaxText's rule list for `settings` (or keyword MaxText keys); [] when quantization is empty."""
  s = dataclasses.replace(settings or QuantSettings(), **keys)
  _check_mode(s.quantization)
  if not s.quantization:
    return []
  rules = [] if s.quantize_router_proj else [router_unquantized_rule()]
  if s.quantization == "fp8_full":
    if s.quantize_logits_proj:
      rules.append(_logits_rule(s))
    rules.append(_fp8_full_main_rule(s))
    return rules
  qtype = _SINGLE_RULE_QTYPES[s.quantization]
  shards = s.quantization_local_shard_count if s.quantization_local_shard_count > 0 else 1
  rules.append(qwix.QtRule(module_path=DECODER_LAYERS_PATH, weight_qtype=qtype, act_qtype=qtype, bwd_qtype=qtype,
                           bwd_weight_grad_tile_size=1 / shards, op_names=("dot_general",)))
  return rules


def router_unquantized_rule() -> qwix.QtRule:
  """The all-None rule MaxText puts first when quantize_router_proj=false: matched routers stay plain."""
  return qwix.QtRule(module_path=ROUTER_PATH, weight_qtype=None, act_qtype=None, bwd_qtype=None,
                     op_names=("dot_general",))


def _drhs_override(s: QuantSettings) -> dict[str, str]:
  method = s.drhs_grad_quantization_calibration_method
  return {"drhs_grad_calibration_method": method} if method else {}


def _logits_rule(s: QuantSettings) -> qwix.QtRule:
  method = s.logits_proj_quant_calibration_method
  return qwix.QtRule(
      module_path=LOGITS_PATH,
      weight_qtype=jnp.float8_e4m3fn,
      act_qtype=jnp.float8_e4m3fn,
      bwd_qtype=jnp.float8_e5m2,
      weight_calibration_method=method or s.weight_quantization_calibration_method,
      act_calibration_method=method or s.act_quantization_calibration_method,
      bwd_calibration_method=s.bwd_quantization_calibration_method,
      additional_qt_config=_drhs_override(s) or None,
      op_names=("dot_general",),
  )


def _fp8_full_main_rule(s: QuantSettings) -> qwix.QtRule:
  sparsity_rule = None
  if s.weight_sparsity_n and s.weight_sparsity_m:
    sparsity_rule = compat.sparsity_rule_class()(
        weight_sparsity_n=s.weight_sparsity_n,
        weight_sparsity_m=s.weight_sparsity_m,
        weight_sparsity_update_step=s.weight_sparsity_update_step,
        weight_sparsity_start_step=s.weight_sparsity_start_step,
    )
  return qwix.QtRule(
      module_path=DECODER_AND_MTP_PATH if s.quantize_mtp else DECODER_LAYERS_PATH,
      weight_qtype=jnp.float8_e4m3fn,
      act_qtype=jnp.float8_e4m3fn,
      bwd_qtype=jnp.float8_e5m2,
      weight_calibration_method=s.weight_quantization_calibration_method,
      act_calibration_method=s.act_quantization_calibration_method,
      bwd_calibration_method=s.bwd_quantization_calibration_method,
      additional_qt_config={"sparsity_rule": sparsity_rule, **_drhs_override(s)},
      op_names=FP8_FULL_OPS,
  )


def _check_mode(quantization: str) -> None:
  if quantization not in QUANTIZATION_MODES:
    raise errors.QuantError(f"unknown quantization {quantization!r}; accepted: "
                            f"{', '.join(repr(m) for m in QUANTIZATION_MODES)}")


# ---------------------------------------------------------------------------------------------------------
# Qtype names and rule records (for reports and rule files).

def qtype_name(qtype: Any) -> str | None:
  """'float8_e4m3fn' for jnp.float8_e4m3fn, the string itself for Qwix's string qtypes, None for None."""
  if qtype is None:
    return None
  if isinstance(qtype, str):
    return qtype
  return jnp.dtype(qtype).name


def rule_record(rule: qwix.QtRule) -> dict[str, Any]:
  """A rule as plain data (qtypes as names): what a rule file would hold for it."""
  out: dict[str, Any] = {}
  for field in dataclasses.fields(rule):
    value = getattr(rule, field.name)
    if field.name in _QTYPE_FIELDS:
      value = qtype_name(value)
    elif field.name == "additional_qt_config" and value is not None:
      value = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in value.items()}
    elif isinstance(value, (tuple, list)):
      value = list(value)
    out[field.name] = value
  return out


# ---------------------------------------------------------------------------------------------------------
# User rule files.

RULE_FIELDS = tuple(f.name for f in dataclasses.fields(qwix.QtRule))


def load_rule_file(path: str | os.PathLike) -> list[qwix.QtRule]:
  """Reads a YAML rule file: a list of mappings of `qwix.QtRule` fields, first match wins.

  Qtypes are names (`float8_e4m3fn`, `int8`, `nf4`, ... or null); `op_names` a list (or one name);
  `additional_qt_config.sparsity_rule` a mapping of `SparsityRule` fields. Every problem raises a one-line
  `QuantError` naming the file, the rule index and the field.
  """
  where = f"rule file {os.fspath(path)!r}"
  data = yaml_file.load(path, where, errors.QuantError)
  if not isinstance(data, list):
    raise errors.QuantError(f"{where} must hold a YAML list of rules (mappings of QtRule fields), "
                            f"got {type(data).__name__}")
  return parse_rules(data, where=where)


def parse_rules(data: Sequence[Any], *, where: str = "rules") -> list[qwix.QtRule]:
  """Validates plain rule records (as read from YAML/JSON) and builds `qwix.QtRule`s."""
  return [_parse_rule(item, f"{where}: rule {index}") for index, item in enumerate(data)]


def _parse_rule(item: Any, where: str) -> qwix.QtRule:
  if not isinstance(item, Mapping):
    raise errors.QuantError(f"{where} must be a mapping of QtRule fields, got {type(item).__name__}")
  values: dict[str, Any] = {}
  for key, value in item.items():
    if key not in RULE_FIELDS:
      close = difflib.get_close_matches(str(key), RULE_FIELDS, n=1, cutoff=0.5)
      hint = f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(RULE_FIELDS)}"
      raise errors.QuantError(f"{where}: unknown field {key!r}{hint}")
    values[key] = _parse_field(key, value, f"{where} field {key!r}")
  return qwix.QtRule(**values)


def _parse_field(key: str, value: Any, where: str) -> Any:
  if key == "module_path":
    if not isinstance(value, str):
      raise errors.QuantError(f"{where}: expected a regex string, got {value!r}")
    try:
      safe_regex.check(value)
    except ValueError as e:
      raise errors.QuantError(f"{where}: regex {value!r} {e}") from None
    return value
  if key == "op_names":
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
      raise errors.QuantError(f"{where}: expected a list of op names (e.g. [dot_general, gmm]), got {value!r}")
    return tuple(names)
  if key in _QTYPE_FIELDS:
    return _parse_qtype(value, where)
  if key in ("tile_size", "bwd_weight_grad_tile_size"):
    return _parse_tile(value, where)
  if key in ("act_static_scale", "disable_channelwise_axes"):
    return _parse_bool(value, where, nullable=key == "act_static_scale")
  if key.endswith("calibration_method"):
    if value is None and key == "act_calibration_method":
      return None
    return _parse_calibration(value, where)
  if key in ("act_batch_axes", "channelwise_noise_axes"):
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
      return tuple(value)
    raise errors.QuantError(f"{where}: expected a list of axis integers, got {value!r}")
  if key == "bwd_stochastic_rounding":
    if value is None or value in STOCHASTIC_ROUNDING:
      return value
    raise errors.QuantError(f"{where}: unknown method {value!r}; accepted: {', '.join(STOCHASTIC_ROUNDING)}, null")
  if key == "additional_qt_config":
    return _parse_additional(value, where)
  return value


def _parse_tile(value: Any, where: str) -> Any:
  if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf):
    return value
  raise errors.QuantError(f"{where}: expected a positive int (tile size) or float (1/tile count), got {value!r}")


def _parse_bool(value: Any, where: str, nullable: bool = False) -> Any:
  if isinstance(value, bool) or (value is None and nullable):
    return value
  raise errors.QuantError(f"{where}: expected true or false{' or null' if nullable else ''}, got {value!r}")


def _parse_qtype(value: Any, where: str) -> Any:
  if value is None:
    return None
  if isinstance(value, str) and value in DTYPE_QTYPES:
    return getattr(jnp, value)
  if isinstance(value, str) and value in STRING_QTYPES:
    return value
  raise errors.QuantError(f"{where}: unknown qtype {value!r}; accepted: {', '.join(ACCEPTED_QTYPES)}, null")


def _parse_calibration(value: Any, where: str) -> str:
  accepted = "absmax[,<scale>], minmax[,<scale>], rms,<scale>, fixed,<min>,<max>"
  if not isinstance(value, str):
    raise errors.QuantError(f"{where}: expected a calibration method ({accepted}), got {value!r}")
  method, *args = [part.strip() for part in value.split(",")]
  counts = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (2, 2)}
  ok = method in counts and counts[method][0] <= len(args) <= counts[method][1]
  try:
    ok = ok and all(math.isfinite(float(a)) for a in args)
  except ValueError:
    ok = False
  if not ok:
    raise errors.QuantError(f"{where}: invalid calibration method {value!r}; accepted: {accepted}")
  return value


def _parse_additional(value: Any, where: str) -> dict[str, Any] | None:
  if value is None:
    return None
  if not isinstance(value, Mapping):
    raise errors.QuantError(f"{where}: expected a mapping of DotGeneralQtConfig fields, got {value!r}")
  accepted = tuple(f.name for f in dataclasses.fields(compat.dot_general_qt_config_class()))
  out: dict[str, Any] = {}
  for key, item in value.items():
    if key not in accepted:
      close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.5)
      hint = f"; did you mean {close[0]!r}?" if close else ""
      raise errors.QuantError(f"{where}: unknown DotGeneralQtConfig field {key!r}{hint}")
    if key == "sparsity_rule" and item is not None:
      item = _parse_sparsity(item, f"{where}.sparsity_rule")
    elif key.endswith("_qtype"):
      item = _parse_qtype(item, f"{where}.{key}")
    elif key.endswith("calibration_method"):
      item = _parse_calibration(item, f"{where}.{key}")
    elif key.endswith("tile_size"):
      item = _parse_tile(item, f"{where}.{key}")
    elif key.endswith(("channelwise_axes", "gradient_clipping", "original_residuals")):
      item = _parse_bool(item, f"{where}.{key}")
    elif item is not None:  # callables (quant-stat collectors, noise functions) cannot come from a file
      raise errors.QuantError(f"{where}.{key}: only null can be given in a rule file, got {item!r}")
    out[key] = item
  return out


def _parse_sparsity(value: Any, where: str) -> Any:
  accepted = tuple(f.name for f in dataclasses.fields(compat.sparsity_rule_class()))
  if not isinstance(value, Mapping):
    raise errors.QuantError(f"{where}: expected a mapping of SparsityRule fields ({', '.join(accepted)})")
  unknown = [k for k in value if k not in accepted]
  if unknown:
    close = difflib.get_close_matches(str(unknown[0]), accepted, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(accepted)}"
    raise errors.QuantError(f"{where}: unknown field {unknown[0]!r}{hint}")
  for key, item in value.items():
    if key == "eval_mode":
      _parse_bool(item, f"{where}.{key}")
    elif key.endswith("_order"):
      if item not in ("R", "C"):
        raise errors.QuantError(f"{where}.{key}: expected 'R' (rows) or 'C' (columns), got {item!r}")
    elif not (isinstance(item, int) and not isinstance(item, bool) and item >= 0):
      raise errors.QuantError(f"{where}.{key}: expected an integer >= 0, got {item!r}")
  return compat.sparsity_rule_class()(**value)
