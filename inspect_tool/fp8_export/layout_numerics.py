"""The `deepseek-fp8` layout's own numerics on a float model: what validation runs the source and the export with.

DeepSeek-V3's release layout stores every Linear weight that `hf_names` marks FP8 (attention projections, dense
MLPs, shared and routed experts, the MTP transformer layers) as float8_e4m3fn with one float32 `weight_scale_inv`
per 128×128 block of the (out, in) matrix, and its servers run those Linears on activations quantized 1×128
dynamically (`quant.act_tiles`); embeddings, the head, norms, the router and `eh_proj` stay in bf16 / float32.

* `layout_weights(model, cfg)`: replaces, in place, each such weight of a float model by what the layout stores,
  dequantized (blocks cut in Hugging Face's (out, in) order, rope columns interleaved as written), with the same
  `quant.fp8.block_quantize` the writer uses, and every other weight by its bfloat16 rounding (`deepseek-bf16`:
  all of them).
* `under_layout(model, cfg)`: the model with those Linears' activations quantized 1×128 (`act_tiles.ActTileProvider`
  over one rule for their dot_generals and one for the routed experts' grouped matmuls).

Validation runs the source through both and the export read back (fp8 × scale_inv) through the second, so an exact
write compares at KL 0, and any tensor written wrong (name, block, scale, rope order) shows. With `--scale-fmt
ue8m0` the blocks' scales are powers of two. `deepseek-v4`: its FP8 Linears through the same power-of-two 128×128
blocks, its routed experts through FP4 (e2m1, one e8m0 scale per 32 values, `quant.microscaling`), bf16 where the
release stores bf16, float32 as is; activations are not quantized (weights only: the release's serving kernels are
not modelled).
"""

from __future__ import annotations

import functools
import re

import jax
import ml_dtypes
import numpy as np
import qwix

from inspect_tool import model as model_lib
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from quant import act_tiles
from quant import fp8
from quant import microscaling
from quant import microscaling_quantize

DENSE_OPS = ("dot_general",)
EXPERT_OPS = ("gmm", "ragged_dot")


def _fp8_entries(cfg) -> dict[tuple[str, ...], hf_names.Entry]:
  return {key: entry for key, entry in hf_names.leaf_plan(cfg).items()
          if entry.rule.kind in (hf_names.FP8, hf_names.EXPERTS_FP8)}


def rules(cfg) -> list:
  """`ActTileRule`s (e4m3, tiles of 128) for exactly the modules whose weights the layout stores in FP8."""
  modules = {kind: sorted("/".join(key[2:-1]) for key, entry in _fp8_entries(cfg).items() if entry.rule.kind == kind)
             for kind in (hf_names.FP8, hf_names.EXPERTS_FP8)}
  out = []
  for kind, ops in ((hf_names.FP8, DENSE_OPS), (hf_names.EXPERTS_FP8, EXPERT_OPS)):
    if modules[kind]:
      pattern = "(" + "|".join(re.escape(m) for m in modules[kind]) + ")"
      out.append(act_tiles.ActTileRule(module_path=pattern, op_names=ops, act_qtype=act_tiles.QTYPE,
                                       act_tile_size=act_tiles.TILE))
  return out


@functools.cache
def _qdq(power_of_two: bool = False):
  def qdq(w_oi):
    qvalue, scale_inv = fp8.block_quantize(w_oi, hf_names.BLOCK, "float8_e4m3fn", power_of_two=power_of_two)
    return fp8.block_dequantize(qvalue, scale_inv, hf_names.BLOCK)
  return jax.jit(qdq)


def _fp4_qdq(w_oi: np.ndarray) -> np.ndarray:
  return microscaling.fp4_dequantize(*(np.asarray(a) for a in microscaling_quantize.fp4_quantize(w_oi)))


def _layer_kernel(value: np.ndarray, entry: hf_names.Entry, cfg, layout) -> np.ndarray:
  """One layer's kernel (MaxText layout) as the layout stores it, dequantized."""
  rule, pow2 = entry.rule, bool(layout.scale_fmt)
  if rule.kind == hf_names.EXPERTS_FP8:  # (X, in, out): each expert an (out, in) Linear
    w_oi = np.swapaxes(value.astype(np.float32), 1, 2)
    stored = np.stack([_fp4_qdq(w) for w in w_oi]) if layout.v4 else np.asarray(_qdq(pow2)(w_oi))
    return np.swapaxes(stored, 1, 2)
  if rule.kind == hf_names_v4.GROUPED_FP8:
    w_oi = np.asarray(_qdq(pow2)(hf_names_v4.grouped_matrix(value)))
    return hf_names_v4.to_maxtext(rule, w_oi, value.shape, cfg)
  w_oi = np.asarray(_qdq(pow2)(hf_names.hf_matrix(value, rule, cfg)))
  return hf_names.maxtext_kernel(w_oi, rule, value.shape, cfg, stored_interleaved=True)


_AS_IS = (hf_names.F32, hf_names.F32_LINEAR, hf_names_v4.TABLE, hf_names_v4.ONES) + hf_names_v4.MHC_KINDS


def layout_weights(model, cfg, layout):
  """`model` (float) with every weight replaced, in place, by what `layout` (`hf_layouts.HfLayout`) stores, read
  back as float: the quantized ones dequantized from their blocks (or FP4 groups), the rest rounded to bfloat16
  (`deepseek-bf16`: all of them); float32 tensors (the router's bias, V4's mHC, sinks, ape) as is."""
  plan = hf_names_v4.plan(cfg)
  quantized = (hf_names.FP8, hf_names.EXPERTS_FP8, hf_names_v4.GROUPED_FP8) if layout.fp8 else ()

  def replace(key, value):
    entry = plan.get(key) or plan.get(tree.param_key(key[2:])) or plan.get(tree.aux_key(key[2:]))
    if entry is None or entry.rule.kind in _AS_IS:
      return None
    value = np.asarray(jax.device_get(value), np.float32)
    if entry.rule.kind not in quantized:
      return value.astype(ml_dtypes.bfloat16).astype(np.float32)
    if entry.layer_axis is None:
      return _layer_kernel(value, entry, cfg, layout)
    layers = np.moveaxis(value, entry.layer_axis, 0)
    return np.moveaxis(np.stack([_layer_kernel(layer, entry, cfg, layout) for layer in layers]), 0,
                       entry.layer_axis)

  params.replace_values(model, replace)
  return model


def under_layout(model, cfg):
  """`model` run with the layout's activation numerics (1×128 e4m3 before every FP8-layout Linear)."""
  args, kwargs = model_lib.qwix_init_inputs(cfg)
  return qwix.quantize_model(model, act_tiles.ActTileProvider(rules(cfg)), *args, skip_nnx_init=True, **kwargs)
