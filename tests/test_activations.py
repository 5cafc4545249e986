"""The activation estimate (`inspect_tool/sharding/activations.py`) against XLA's own `memory_analysis()` of the
forward + backward step (`run.runner.grad_step`, what `forward --grad` runs) compiled on CPU.

XLA's `temp_size_in_bytes` is everything the compiled step holds besides its arguments (the parameters) and
outputs (loss, gradients). `param_scan_axis=0` keeps the stacked layers' axis where the scan reads it: with
MaxText's default 1 our scan also holds transposed copies of the stacked parameters and their gradients, which are
XLA temporaries but not activations. Measured ratios estimate / XLA (2026-12-01, jax 0.12.0.1 CPU, MaxText's
stack), L4 model with MTP, `attention=dot_product`: batch 4 × 128: 0.980 (remat none), 0.946 (full); 8 × 256: 1.022,
1.011; the same without MTP: 0.845, 1.022 (4 × 128), 0.973 (8 × 256, full). jax 0.10.2's XLA (the Python 3.11
stack) holds more for the same step: 0.597, 0.538 (4 × 128), 0.590, 0.485 (8 × 256).
"""

import jax
import pytest

from inspect_tool import model as model_lib
from inspect_tool.configuration import config
from inspect_tool.run import batch as batch_lib
from inspect_tool.run import runner
from inspect_tool.sharding import activations

L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024", "param_scan_axis=0", "attention=dot_product"]


def _xla_temp_bytes(cfg, batch: int, seq: int, remat: str) -> int:
  model = model_lib.build_model(cfg, abstract=True)  # shapes only: nothing is allocated or run
  model.decoder.remat_policy = remat
  data = batch_lib.make_batch(batch_lib.fixed_tokens(batch, seq, cfg.vocab_size))
  step, params, rest = runner.grad_step(model, data)
  return step.lower(params, rest).compile().memory_analysis().temp_size_in_bytes


# The measured band of estimate / XLA temp bytes, with a margin of about 0.02 on each side, per XLA.
BAND = (0.93, 1.04) if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12) else (0.465, 0.62)


@pytest.mark.parametrize("batch, seq", [(4, 128), (8, 256)])
@pytest.mark.parametrize("remat", ["full", "minimal"])
def test_estimate_is_within_the_measured_band_of_xla_memory_analysis(batch, seq, remat):
  cfg = config.resolve_config(L4 + [f"per_device_batch_size={batch}", f"max_target_length={seq}",
                                    f"remat_policy={remat}"])
  estimate = activations.estimate(cfg)
  assert (estimate.batch, estimate.seq, estimate.remat_policy) == (batch, seq, remat)
  # `minimal` is estimated as "everything saved": the step is compiled without rematerialisation.
  xla = _xla_temp_bytes(cfg, batch, seq, "full" if remat == "full" else None)
  assert BAND[0] <= estimate.total / xla <= BAND[1], (estimate.total, xla, estimate.total / xla)


def test_remat_full_saves_layer_inputs_and_flash_attention_drops_the_scores():
  """Hand-computed from the documented formula with the L4 sizes (E 64, H 4, dq 192, dv 128, rq 32, rkv 16,
  dr 64, X 16, K 8, M 64, D 64, V 1024, one shared expert), bf16 compute (a = 2), B 4, S 128 (T 512)."""
  cfg = config.resolve_config(L4 + ["per_device_batch_size=4", "max_target_length=128"])
  attention = 4 * 64 + 2 * 32 + 3 * 4 * 192 + (16 + 64) + 16 + 4 * (128 + 128) + 4 * 128  # 4256 per token
  moe = 2 * 2 * 16 + 8 * (2 * 64 + 4 * 64) + 2 * 2 * 8 * 64 + 4 * 64 + 64  # 5504
  dense = 4 * 64 + 64
  scores = (2 + 4) * 4 * 4 * 128 * 128
  t = 512
  moe_layer = t * 2 * (attention + moe) + scores
  dense_layer = t * 2 * (attention + dense) + scores
  mtp = moe_layer + t * 2 * 3 * 64
  heads = 2 * 2 * 4 * t * 1024
  none = activations.estimate(cfg, remat_policy="minimal")
  assert none.total == 3 * moe_layer + dense_layer + mtp + heads == 61_112_320
  full = activations.estimate(cfg, remat_policy="full")
  assert full.total == 4 * t * 64 * 2 + max(moe_layer, mtp) + heads == 20_414_464
  flash = activations.estimate(config.resolve_config(L4[:-1] + ["attention=autoselected"]), batch=4, seq=128,
                               remat_policy="minimal")
  assert none.total - flash.total == 5 * scores
