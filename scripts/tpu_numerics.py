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
import numpy as np
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from inspect_tool.configuration import config  # noqa: E402  pylint: disable=wrong-import-position
from inspect_tool.run import forward as forward_lib  # noqa: E402  pylint: disable=wrong-import-position
from inspect_tool.run import runner  # noqa: E402  pylint: disable=wrong-import-position
import fp8_products  # noqa: E402  pylint: disable=wrong-import-position

DATA = REPO / "tests" / "data"
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]


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
    print(f"chip vs this host's CPU, {label:11s}: main rel {fp8_products.rel(chip.logits, host.logits):.3e}, mtp rel "
          f"{fp8_products.rel(chip.mtp_logits[0], host.mtp_logits[0]):.3e}; top-1 "
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
      main, mtp = fp8_products.rel(out.logits, ref["logits"]), fp8_products.rel(out.mtp_logits[0], ref["mtp_logits"])
      top1 = int((np.asarray(out.top1) == ref["top1"]).sum())
      mtp_top1 = int((np.asarray(out.mtp_top1[0]) == ref["mtp_top1"]).sum())
      print(f"forward {quant:8s} matmul_precision={precision:8s} vs {name:18s} main rel {main:.3e} top-1 "
            f"{top1}/32   mtp rel {mtp:.3e} top-1 {mtp_top1}/32", flush=True)


def product_figures() -> None:
  got = fp8_products.measure()
  kind = jax.devices()[0].device_kind
  print(f"qwix QT dot_general on {kind}: vs numpy fp8 {got.dense_vs_fp8:.3e}, vs numpy unquantized "
        f"{got.dense_vs_plain:.3e}", flush=True)
  print(f"gmm fp8_full ({got.backend}) on {kind}: vs numpy fp8 {got.gmm_vs_fp8:.3e}, vs numpy unquantized "
        f"{got.gmm_vs_plain:.3e}", flush=True)


if __name__ == "__main__":
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  product_figures()
  if jax.default_backend() != "cpu":
    amplification_figures()
  forward_figures()
