"""Quantized-training (Qwix QT) forward on MaxText's checkpoint against MaxText's fp8_full golden outputs."""

import os

import numpy as np
import pytest

from inspect_tool import batch, config, metrics, running

DATA = os.path.join(os.path.dirname(__file__), "data")
CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
GOLDEN = {False: "b_fp8full_mtpfalse.npz", True: "c_fp8full_mtptrue.npz"}


def _golden(name):
  return np.load(os.path.join(DATA, "golden", name))


def _rel(x, y):
  return float(np.linalg.norm(np.asarray(x) - y) / np.linalg.norm(y))


@pytest.fixture(scope="module")
def source_model():
  return running.load_model(config.resolve_config(TINY), CKPT)


@pytest.fixture(scope="module")
def fp8_results(source_model):
  data = batch.make_batch(batch.fixed_tokens(2, 16, 1024))
  out = {}
  for quantize_mtp in (False, True):
    cfg = config.resolve_config(TINY + ["quantization=fp8_full", f"quantize_mtp={str(quantize_mtp).lower()}"])
    out[quantize_mtp] = running.forward(running.quantize_for_training(source_model, cfg), data)
  out["none"] = running.forward(source_model, data)
  return out


@pytest.mark.parametrize("quantize_mtp", [False, True])
def test_fp8_full_matches_maxtext_golden(fp8_results, quantize_mtp):
  result, golden = fp8_results[quantize_mtp], _golden(GOLDEN[quantize_mtp])
  other = _golden(GOLDEN[not quantize_mtp])
  assert np.array_equal(golden["tokens"], batch.fixed_tokens(2, 16, 1024))
  assert _rel(result.logits, golden["logits"]) <= 0.04
  assert (np.asarray(result.top1) == golden["top1"]).sum() >= 29
  mtp = np.asarray(result.mtp_logits[0])
  assert _rel(mtp, golden["mtp_logits"]) <= 0.07
  assert (mtp.argmax(-1) == golden["mtp_top1"]).sum() >= 27
  assert _rel(mtp, golden["mtp_logits"]) < _rel(mtp, other["mtp_logits"])


def test_quantize_mtp_changes_only_the_mtp_head(fp8_results):
  off, on = fp8_results[False], fp8_results[True]
  assert np.array_equal(np.asarray(off.logits), np.asarray(on.logits))
  assert _rel(off.mtp_logits, np.asarray(on.mtp_logits)) > 0.01


def test_quantization_visibly_changes_logits_but_keeps_them_close(fp8_results):
  rows = metrics.compare_heads(fp8_results["none"], fp8_results[True])
  assert [r.head for r in rows] == ["main", "mtp_1"]
  for row in rows:
    assert 0.98 < row.cosine < 1.0 and row.top1_agreement >= 0.7 and 0 < row.kl < 0.05


def test_quantized_gradient_step_is_finite(source_model):
  cfg = config.resolve_config(TINY + ["quantization=fp8_full", "quantize_mtp=true"])
  data = batch.make_batch(batch.fixed_tokens(2, 16, 1024))
  loss, norm, finite = running.loss_and_grad_norm(running.quantize_for_training(source_model, cfg), data)
  assert finite and np.isfinite(loss) and loss > 0 and norm > 0


def test_megablox_false_quantizes_experts_through_qwix_ragged_dot():
  """Qwix's own ragged_dot QT path: MaxText's two fp8 expert paths differ by ~0.02, inside the fp8 tolerance."""
  cfg = config.resolve_config(TINY + ["quantization=fp8_full", "quantize_mtp=true", "megablox=false"])
  data = batch.make_batch(batch.fixed_tokens(2, 16, 1024))
  result = running.forward(running.quantize_for_training(running.load_model(cfg, CKPT), cfg), data)
  golden = _golden(GOLDEN[True])
  assert 0.005 < _rel(result.logits, golden["logits"]) <= 0.04
  assert (np.asarray(result.top1) == golden["top1"]).sum() >= 29
