"""The grouped-matmul backends: our Pallas kernel and JAX's Megablox (interpret mode on CPU), XLA ragged_dot, against
the reference.

Bound: with fp8 operands every product is exact in float32, so a kernel can differ from the reference only by
the order of its float32 sums. Measured (these shapes, jax 0.12.0.1 and 0.10.2 on CPU, relative to the largest
value): 0 for every FP8 case on Pallas and XLA, ragged K and N tiles included (at these sizes the sums of fp8
products are exact too); up to 1.6e-7 for XLA's float32 plain path. The tests allow 1e-6 (FP8_NOISE). At
DeepSeek-V3 sizes (K 7168) the sums round: order noise is then bounded by about K * 6e-8 relative (not measured).
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from inspect_tool.run import batch
from inspect_tool.configuration import config
from inspect_tool.run import runner as running
from quant import errors
from quant.gmm import backends as gmm_backends
from quant.gmm import fp8 as gmm_fp8
from quant.gmm import kernel as gmm_kernel
from quant.gmm import megablox as gmm_megablox
from quant.gmm import pallas as gmm_pallas
from quant.gmm import target as gmm_target
from quant.gmm import tiles as gmm_tiles

import golden_parity

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_RULE = qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=E5M2)
GROUPS = np.array([7, 0, 13, 0, 11], np.int32)  # empty groups; 31 rows in groups, 9 past them; tiles of 16 rows
M, K, N = 40, 24, 20
FP8_NOISE = 1e-6
from conftest import DATA
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full", "quantize_mtp=true"]


def _data(seed=0, m=M, k=K, n=N, groups=GROUPS):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(len(groups), k, n)).astype(np.float32),
          rng.normal(size=(m, n)).astype(np.float32))


def _interpreted(fn):
  """`fn` with the Pallas kernels in interpret mode (these shapes are below Mosaic's tiles), also on a TPU host."""
  @functools.wraps(fn)
  def run(*args, **kwargs):
    with gmm_target.compiling_for("cpu"):
      return fn(*args, **kwargs)
  return run


@_interpreted
def _run(backend, rule, dtype, seed=0):
  """Output, dlhs and drhs of the grouped matmul on `backend` (float64 numpy)."""
  lhs, rhs, cot = _data(seed)
  lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
  tiles = gmm_tiles.Tiles(*[gmm_kernel.Tiling(16, 16, 16)] * 3)
  f = lambda l, r: gmm_fp8.quantized_gmm(l, r, GROUPS, rule, jnp.float32, tile_rows=16, backend=backend, tiles=tiles)
  out, vjp = jax.vjp(f, lhs, rhs)
  return [np.asarray(x, np.float64) for x in (out, *vjp(jnp.asarray(cot)))]


def _max_rel(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("backend", ["pallas", "megablox", "xla"] + (["tokamax"] if gmm_backends.tokamax_installed()
                                                                     else []))
@pytest.mark.parametrize("rule,dtype", [(FP8_RULE, jnp.bfloat16), (None, jnp.float32)], ids=["fp8", "plain"])
def test_backend_equals_the_reference_forward_and_vjp(backend, rule, dtype):
  got, want = _run(backend, rule, dtype), _run("reference", rule, dtype)
  for name, g, w in zip(("out", "dlhs", "drhs"), got, want):
    assert _max_rel(g, w) <= FP8_NOISE, name
  assert np.all(got[0][GROUPS.sum():] == 0) and np.all(got[1][GROUPS.sum():] == 0)  # rows past the groups
  assert np.all(got[2][[1, 3]] == 0)  # empty groups get no weight gradient
  if rule is not None:  # and the result is quantized, not a float matmul
    assert _max_rel(got[0], _run(backend, None, dtype)[0]) > 0.005


def _segments(groups):
  start = 0
  for g, size in enumerate(groups):
    yield g, slice(start, start + int(size))
    start += int(size)


@pytest.mark.parametrize("module", [gmm_pallas, gmm_megablox], ids=["pallas", "megablox"])
@_interpreted
def test_pallas_kernels_with_ragged_k_and_n_tiles_on_fp8_values(module):
  """K=40 and N=24 against tiles of 16 (partial last tiles), rows straddling row tiles, fp8 operands."""
  lhs, rhs, cot = _data(1, m=48, k=40, n=24)
  groups = np.array([5, 0, 21, 12, 0], np.int32)  # 38 rows in groups
  lhs8, rhs8 = jnp.asarray(lhs, E4M3), jnp.asarray(rhs, E4M3)
  cot8 = jnp.asarray(np.where(np.arange(48)[:, None] < 38, cot, 0), E5M2)
  tiling = gmm_kernel.Tiling(16, 16, 16)
  out = np.asarray(module.matmul(lhs8, rhs8, jnp.asarray(groups), tiling=tiling), np.float64)[:38]
  dlhs = np.asarray(module.matmul(cot8, rhs8, jnp.asarray(groups), tiling=tiling, transpose_rhs=True),
                    np.float64)[:38]
  drhs = np.asarray(module.outer(lhs8, cot8, jnp.asarray(groups), tiling=tiling), np.float64)
  l64, r64, c64 = (np.asarray(x, np.float64) for x in (lhs8, rhs8, cot8))
  want_out, want_dlhs, want_drhs = np.zeros((38, 24)), np.zeros((38, 40)), np.zeros((5, 40, 24))
  for g, rows in _segments(groups):
    want_out[rows] = l64[rows] @ r64[g]
    want_dlhs[rows] = c64[rows] @ r64[g].T
    want_drhs[g] = l64[rows].T @ c64[rows]
  for got, want in ((out, want_out), (dlhs, want_dlhs), (drhs, want_drhs)):
    assert _max_rel(got, want) <= FP8_NOISE


@pytest.mark.parametrize("groups", [[5, 0, 21, 12, 0], [16, 16, 0, 0, 0], [0, 0, 0, 0, 0], [10, 10, 10, 10, 8]],
                         ids=["tail-inside-a-tile", "tail-whole-tiles", "no-rows", "no-tail"])
@_interpreted
def test_pallas_kernel_stores_zeros_past_the_groups_over_what_was_there(groups):
  """`kernel.gmm(zero_tail=True)`: the rows past the groups come back 0 (the output buffer starts as garbage: rows of
  a tile shared with the last group keep that group's products), both ways of the weight, 48 rows in tiles of 16."""
  lhs, rhs, _ = _data(2, m=48, k=40, n=24)
  groups = np.array(groups, np.int32)
  total = int(groups.sum())
  l64, r64 = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  for transpose in (False, True):
    weight = np.swapaxes(rhs, 1, 2).copy() if transpose else rhs
    out = np.asarray(gmm_kernel.gmm(jnp.asarray(lhs), jnp.asarray(weight), jnp.asarray(groups), tiling=gmm_kernel.Tiling(16, 16, 16),
                                    transpose_rhs=transpose, interpret=True, zero_tail=True), np.float64)
    want = np.zeros((48, 24))
    for g, rows in _segments(groups):
      want[rows] = l64[rows] @ r64[g]
    assert np.all(out[total:] == 0), transpose
    assert _max_rel(out[:total], want[:total]) <= FP8_NOISE if total else True


def test_pallas_forward_of_the_fp8_model_matches_maxtexts_golden_as_the_reference_does():
  """`forward ... quantization=fp8_full quantize_mtp=true gmm_backend=pallas` on MaxText's checkpoint.

  Pallas gives what the reference path gives (tests/test_running.py holds that to MaxText's tolerance), measured
  against the golden: 0 on jax 0.12.0.1; 8.5e-8 (main) and 2.2e-5 (MTP) on jax 0.10.2, where the reference path
  shows the same figures. Bound: 1e-4, and every top-1 token; on a TPU chip (the kernel compiled by Mosaic there)
  the chip's bounds (`golden_parity`).
  """
  golden = np.load(os.path.join(DATA, "golden", "c_fp8full_mtptrue.npz"))
  cfg = config.resolve_config(TINY + ["gmm_backend=pallas"])
  model = running.load_model(cfg, os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024"))
  assert model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gmm_backend == "pallas"
  result = running.forward(running.quantize_for_training(model, cfg), batch.make_batch(batch.fixed_tokens(2, 16, 1024)))
  if golden_parity.ON_TPU:
    golden_parity.assert_fp8_reproduces(result.logits, golden["logits"], "main")
    golden_parity.assert_fp8_reproduces(result.mtp_logits[0], golden["mtp_logits"], "mtp")
  else:
    rel = golden_parity.rel
    assert rel(result.logits, golden["logits"]) <= 1e-4 and rel(result.mtp_logits[0], golden["mtp_logits"]) <= 1e-4
  golden_parity.assert_top1(result.top1, golden["top1"], "fp8", "main")
  golden_parity.assert_top1(np.asarray(result.mtp_logits[0]).argmax(-1), golden["mtp_top1"], "fp8", "mtp")


def test_auto_picks_pallas_on_tpu_ragged_dot_on_gpu_and_the_reference_on_cpu():
  assert gmm_backends.resolve("auto") == {"cpu": "reference", "tpu": "pallas"}[jax.default_backend()]
  assert gmm_backends.resolve("auto", platform="tpu") == "pallas"
  assert gmm_backends.resolve("auto", platform="gpu") == ("tokamax" if gmm_backends.tokamax_installed() else "xla")
  for name in ("reference", "pallas", "megablox", "xla"):
    assert gmm_backends.resolve(name) == name


def test_unknown_contradictory_or_missing_backends_are_one_clear_error():
  with pytest.raises(errors.QuantError, match="gmm_backend='mosaic' .* accepted: auto, reference, pallas, megablox"):
    gmm_backends.resolve("mosaic")
  with pytest.raises(errors.QuantError, match="contradicts use_tokamax_backend=true"):
    gmm_backends.resolve("pallas", use_tokamax_backend=True)
  if not gmm_backends.tokamax_installed():
    with pytest.raises(errors.QuantError, match="needs the tokamax package"):
      gmm_backends.resolve("auto", use_tokamax_backend=True)
  with pytest.raises(errors.QuantError, match="gmm_backend='fast'; accepted: 'auto'"):
    config.resolve_config(["model_name=deepseek3-tiny", "gmm_backend=fast"])


BAD_KEYS = [
    (["gmm_backend=fast"], "error: gmm_backend='fast'; accepted: 'auto', 'reference', 'pallas', 'megablox', 'xla', "
                             "'tokamax'"),
    (["gmm_backend=xla", "use_tokamax_backend=true"], "error: gmm_backend=xla contradicts use_tokamax_backend=true"),
] + ([] if gmm_backends.tokamax_installed() else [  # an unavailable backend, where it is unavailable
    (["gmm_backend=tokamax"], "error: gmm_backend=tokamax needs the tokamax package, which is not installed")])


@pytest.mark.parametrize("keys,message", BAD_KEYS)
def test_cli_names_a_bad_backend_in_one_line_with_exit_2(keys, message, tmp_path):
  tokens = tmp_path / "t.npy"
  np.save(tokens, batch.fixed_tokens(1, 8, 1024))
  proc = subprocess.run([sys.executable, "-m", "inspect_tool", "forward", "model_name=deepseek3-tiny", *keys,
                         "--tokens", str(tokens)], capture_output=True, text=True, timeout=300, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))  # a test process on a TPU host holds the chip
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert proc.stderr.strip().startswith(message)
