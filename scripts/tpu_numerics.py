"""Where our forward pass on an accelerator stands against MaxText's CPU goldens, and why: figures for docs.

1. The forward pass of MaxText's L4 checkpoint on the golden batch, unquantized at matmul_precision default / high /
   highest and fp8_full (quantize_mtp=true) at default / highest: relative error and top-1 against golden a
   (unquantized) and c (fp8_full).
2. One FP8 product on this device against numpy: Qwix's QT dot_general (MaxText's fp8_full rule: e4m3 activations
   per row, e4m3 weights per column) and our grouped matmul (`quant.gmm.fp8`, gmm_backend auto), each fed inputs made
   here, against a float64 numpy reference that rounds the same inputs to e4m3 with ml_dtypes (the FP8 rounding) and
   against the unquantized product. A product that kept its FP8 rounding is ~1e-7 from the first and ~3e-2 from the
   second.

Prints one line per figure; run it once as it is and once with XLA_FLAGS=--xla_allow_excess_precision=false.

  python scripts/tpu_numerics.py
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from inspect_tool.configuration import config  # noqa: E402  pylint: disable=wrong-import-position
from inspect_tool.run import forward as forward_lib  # noqa: E402  pylint: disable=wrong-import-position
from inspect_tool.run import runner  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import backends as gmm_backends  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import fp8 as gmm_fp8  # noqa: E402  pylint: disable=wrong-import-position

DATA = REPO / "tests" / "data"
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
E4M3 = jnp.float8_e4m3fn


def rel(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def _forward(extra, golden, cpu: bool = False):
  """Our forward pass of the L4 checkpoint on the golden batch, on this host's CPU with `cpu` (same process)."""
  cfg = config.resolve_config(L4 + extra + (["gmm_backend=reference"] if cpu else []))
  model = runner.quantize_for_training(runner.load_model(cfg, str(DATA / "ckpt_deepseek3-tiny-L4-V1024")), cfg)
  args = (golden["tokens"],)
  kwargs = dict(targets=golden["targets"], target_mask=golden["target_mask"], positions=golden["positions"],
                segment_ids=golden["segment_ids"])
  if not cpu:
    return forward_lib.run_forward(model, *args, **kwargs)
  device = jax.devices("cpu")[0]
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.device_put(state, device))
  with jax.default_device(device):
    return forward_lib.run_forward(model, *(jax.device_put(a, device) for a in args),
                                   **{k: jax.device_put(v, device) for k, v in kwargs.items()})


def amplification_figures() -> None:
  """The same forward pass on the chip and on this host's CPU (which reproduces the goldens): how far apart
  unquantized, and how far apart with FP8 (its rounding turns small bf16 differences into other fp8 codes)."""
  g = dict(np.load(DATA / "golden" / "a_noquant.npz"))
  for label, extra in (("unquantized", []), ("fp8_full", ["quantization=fp8_full", "quantize_mtp=true"])):
    chip, host = _forward(extra, g), _forward(extra, g, cpu=True)
    print(f"chip vs this host's CPU, {label:11s}: main rel {rel(chip.logits, host.logits):.3e}, mtp rel "
          f"{rel(chip.mtp_logits[0], host.mtp_logits[0]):.3e}; top-1 "
          f"{int((np.asarray(chip.top1) == np.asarray(host.top1)).sum())}/32", flush=True)


def forward_figures() -> None:
  golden = {name: dict(np.load(DATA / "golden" / f"{name}.npz")) for name in ("a_noquant", "c_fp8full_mtptrue")}
  g = golden["a_noquant"]
  runs = [("none", p, []) for p in ("default", "high", "highest")]
  runs += [("fp8_full", p, ["quantization=fp8_full", "quantize_mtp=true"]) for p in ("default", "highest")]
  for quant, precision, extra in runs:
    cfg = config.resolve_config(L4 + extra + [f"matmul_precision={precision}"])
    model = runner.quantize_for_training(runner.load_model(cfg, str(DATA / "ckpt_deepseek3-tiny-L4-V1024")), cfg)
    out = forward_lib.run_forward(model, g["tokens"], targets=g["targets"], target_mask=g["target_mask"],
                                  positions=g["positions"], segment_ids=g["segment_ids"])
    for name, ref in golden.items():
      main, mtp = rel(out.logits, ref["logits"]), rel(out.mtp_logits[0], ref["mtp_logits"])
      top1 = int((np.asarray(out.top1) == ref["top1"]).sum())
      mtp_top1 = int((np.asarray(out.mtp_top1[0]) == ref["mtp_top1"]).sum())
      print(f"forward {quant:8s} matmul_precision={precision:8s} vs {name:18s} main rel {main:.3e} top-1 "
            f"{top1}/32   mtp rel {mtp:.3e} top-1 {mtp_top1}/32", flush=True)


def _e4m3(x, axis):
  """numpy: x rounded to e4m3 with an absmax scale per index of `axis` (the others reduced), float64 back."""
  amax = np.max(np.abs(x), axis=tuple(a for a in range(x.ndim) if a != axis), keepdims=True)
  scale = amax / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def product_figures() -> None:
  key = jax.random.key(0)
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (256, 512), jnp.float32)  # made on the device; float32 so numpy sees the same values
  w = jax.random.normal(k2, (512, 384), jnp.float32) * 512**-0.5
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  plain = x64 @ w64
  fp8 = _e4m3(x64, 0) @ _e4m3(w64, 1)
  rule = qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3)

  class Layer(nnx.Module):
    """The smallest module Qwix intercepts: one dot_general of an activation with a weight Param."""

    def __init__(self):
      self.kernel = nnx.Param(w)

    def __call__(self, inputs):
      return jax.lax.dot_general(inputs, self.kernel[...], (((1,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST)

  model = qwix.quantize_model(Layer(), qwix.QtProvider([rule]), x)
  dense = np.asarray(jax.jit(lambda m, a: m(a))(model, x), np.float64)
  print(f"qwix QT dot_general on {jax.devices()[0].device_kind}: vs numpy fp8 {rel(dense, fp8):.3e}, "
        f"vs numpy unquantized {rel(dense, plain):.3e}", flush=True)
  groups = jnp.asarray([100, 0, 156], jnp.int32)
  rhs = jax.random.normal(k3, (3, 512, 384), jnp.float32) * 512**-0.5
  rhs64 = np.asarray(rhs, np.float64)
  gmm_rule = qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=jnp.float8_e5m2)
  backend = gmm_backends.resolve("auto")
  out = np.asarray(gmm_fp8.quantized_gmm(x, rhs, groups, gmm_rule, jnp.float32, backend=backend), np.float64)
  rhs_q = np.stack([_e4m3_shared(rhs64)[g] for g in range(3)])
  xq = _e4m3(x64, 0)
  want_fp8 = np.concatenate([xq[:100] @ rhs_q[0], xq[100:] @ rhs_q[2]])
  want_plain = np.concatenate([x64[:100] @ rhs64[0], x64[100:] @ rhs64[2]])
  print(f"gmm fp8_full ({backend}) on {jax.devices()[0].device_kind}: vs numpy fp8 {rel(out, want_fp8):.3e}, "
        f"vs numpy unquantized {rel(out, want_plain):.3e}", flush=True)


def _e4m3_shared(rhs):
  """numpy: [G, K, N] rounded to e4m3 with one absmax scale per output column shared by every group (MaxText's gmm)."""
  amax = np.max(np.abs(rhs), axis=(0, 1), keepdims=True)
  scale = amax / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  return (rhs / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


if __name__ == "__main__":
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  product_figures()
  if jax.default_backend() != "cpu":
    amplification_figures()
  forward_figures()
