"""MaxText's golden forward outputs (tests/data/golden/) and how close our logits must come to them.

Golden a is MaxText's unquantized forward pass on the reference checkpoint, b fp8_full with quantize_mtp=false, c
fp8_full with quantize_mtp=true, d as c with megablox=false. Measured figures and bounds: tests/README.md.
"""

import pathlib

import jax
import numpy as np
import pytest
from conftest import DATA

GOLDEN_DIR = pathlib.Path(DATA) / "golden"
UNQUANTIZED = "a_noquant.npz"
FP8 = {False: "b_fp8full_mtpfalse.npz", True: "c_fp8full_mtptrue.npz"}  # by quantize_mtp
# MaxText's fp8_full quantize_mtp=true forward with megablox=false (Qwix's ragged_dot): golden/make_golden.py
MEGABLOX_FALSE = "d_fp8full_mtptrue_megablox_false.npz"
AWAY = 0.05  # an fp8 result must stand at least this far (relative error) from the unquantized golden
# MaxText's own stack (jax 0.12) reproduces the fp8 goldens bit for bit. jax 0.10 (the Python 3.11 venv) rounds a few
# bf16 values differently: measured there main 8.5e-8, MTP 4.3e-5 (b) / 2.2e-5 (c) relative error, top-1 32/32.
GOLDEN_STACK = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
OTHER_STACK_BOUND = {"main": 1.3e-7, "mtp": 6.6e-5}
# On a TPU chip the goldens (made on a CPU) are met within bounds measured on a TPU v5e (jax 0.10.2, libtpu 0.0.42.1;
# scripts/tpu_numerics.py; docs/benchmarks.md): the chip rounds bf16 intermediates at other points than the CPU
# (its fusions and transcendentals; the unscanned model on a CPU differs from the scanned one by as much), 1e-2
# unquantized at every matmul_precision, and FP8 rounding turns those differences into other fp8 codes (0.1 from
# golden c, while each FP8 product on the chip equals numpy's FP8 arithmetic: tests/test_tpu_chip.py).
ON_TPU = jax.default_backend() == "tpu"
# Measured with XLA rounding as a CPU does (`accelerator.round_like_a_cpu`): unquantized 0.01072 / 0.01237 (main /
# MTP) from golden a, top-1 32/32; fp8_full 0.0980 / 0.1104 from golden c, top-1 28 / 27 of 32; per-token losses
# within 2.8e-3 (without it: 0.0132 / 0.0137 and 0.111 / 0.125).
TPU_BOUND = {("unquantized", "main"): 0.0115, ("unquantized", "mtp"): 0.0130, ("fp8", "main"): 0.105,
             ("fp8", "mtp"): 0.118}
TPU_TOP1 = {("unquantized", "main"): 32, ("unquantized", "mtp"): 32, ("fp8", "main"): 26, ("fp8", "mtp"): 25}


def load(name: str) -> dict:
  return dict(np.load(GOLDEN_DIR / name))


def rel(x, y) -> float:
  """‖x − y‖ / ‖y‖ over the whole array, in float64."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def assert_unquantized_reproduces(logits, golden, head: str) -> None:
  """Unquantized logits: bit for bit on a CPU, within the bound measured on a TPU chip there."""
  if ON_TPU:
    assert (got := rel(logits, golden)) <= TPU_BOUND[("unquantized", head)], f"{head}: relative error {got:.5f}"
  else:
    np.testing.assert_array_equal(np.asarray(logits), golden)


def assert_top1(top1, golden_top1, kind: str, head: str) -> None:
  """Top-1 tokens (kind "unquantized" or "fp8"): all of them on a CPU, as many as measured on a TPU chip."""
  if ON_TPU:
    assert (got := int(np.sum(np.asarray(top1) == golden_top1))) >= TPU_TOP1[(kind, head)], f"{head}: top-1 {got}"
  else:
    np.testing.assert_array_equal(np.asarray(top1), golden_top1)


def assert_fp8_reproduces(logits, golden, head: str, *, exact: bool = False) -> None:
  """fp8 logits: bit for bit on MaxText's stack (on both stacks with `exact`), within the error measured on the older
  stack elsewhere, and on a TPU chip within the bound measured there."""
  if ON_TPU:
    assert (got := rel(logits, golden)) <= TPU_BOUND[("fp8", head)], f"{head}: relative error {got:.5f}"
  elif GOLDEN_STACK or exact:
    np.testing.assert_array_equal(np.asarray(logits), golden)
  else:
    assert rel(logits, golden) <= OTHER_STACK_BOUND[head]


def maxtext_fp8_cost() -> list:
  """Per head (main, mtp_1): how far MaxText's fp8 logits (golden c) are from its unquantized ones (golden a),
  as `metrics.HeadComparison` rows; measured cosine 0.99390 / 0.99221, top-1 29 / 25 of 32, KL 0.00588 / 0.00758,
  relative error 0.1107 / 0.1249."""
  from quant import metrics  # pylint: disable=import-outside-toplevel

  plain, golden = load(UNQUANTIZED), load(FP8[True])
  return [metrics.compare_logits("main", plain["logits"], golden["logits"]),
          metrics.compare_logits("mtp_1", plain["mtp_logits"], golden["mtp_logits"])]


# The cost of fp8_full on the chip against MaxText's on a CPU, measured on a TPU v5e (2026-12-07, the export of the L4
# checkpoint with quantize_mtp=true, `scripts/tpu_run.sh commands`): cosine 0.99384 / 0.99188 (MaxText's 0.99390 /
# 0.99221), KL 0.5% / 4.2% above, relative error 0.5% / 2.0% above, top-1 30 / 24 of 32 (MaxText's 29 / 25). Since
# Qwix quantizes on the fly through `quant.rounding` (`compat.exact_qwix_quantization`), the main head measured on the
# chip (lane, same day): cosine 0.99360, KL 0.006214 (5.7% above), relative error 0.11336 (2.4% above), top-1 28 of
# 32 (the MTP head was not printed); the next lane (same day, the grouped matmul storing its zeros past the groups):
# the MTP head cosine 0.99179 (4.2e-4 below MaxText's), KL 0.007872 (3.8% above), relative error 0.12823 (2.7% above),
# top-1 22 of 32 (MaxText's 25: near-tied logits that the chip's bfloat16 products order otherwise). Bounds:
TPU_COST = {"cosine": 5e-4, "kl": 0.10, "rel_error": 0.05, "top1_positions": 3}


def assert_same_cost(row: dict, want) -> None:
  """An unquantized-vs-fp8 comparison row equals MaxText's (`maxtext_fp8_cost`; on a TPU chip within `TPU_COST`) and
  stands clearly away."""
  assert row["head"] == want.head and row["positions"] == want.positions and row["rel_error"] >= AWAY
  if ON_TPU:
    positions = row["positions"]
    assert abs(row["top1_agreement"] - want.top1_agreement) * positions <= TPU_COST["top1_positions"] + 1e-9, row
    assert abs(row["cosine"] - want.cosine) <= TPU_COST["cosine"], row
    for field in ("kl", "rel_error"):
      assert row[field] == pytest.approx(getattr(want, field), rel=TPU_COST[field], abs=0), (
          f"{field}: {row[field]:.6g} on the chip, MaxText's {getattr(want, field):.6g}", row)
    return
  assert row["top1_agreement"] == want.top1_agreement
  for field in ("cosine", "kl", "rel_error"):
    assert row[field] == pytest.approx(getattr(want, field), rel=1e-5, abs=0), field
