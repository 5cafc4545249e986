"""`capacity_factor` token dropping on the dense MoE path, against a plain numpy reference written from the rule.

The rule (MaxText's dense path, `sparse_matmul=false`, `capacity_factor > 0`): per sequence, expert e accepts its
first C = max(ceil(S·K/X)·capacity_factor, capacity_factor) assignments in (position, k) order; a token's output
is the routing-weighted sum over the experts that accepted it. The reference walks the assignments one by one.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inspect_tool.configuration import config
from inspect_tool.model import initializers as inits
from inspect_tool.model import moe


def _moe(capacity_factor: float):
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "sparse_matmul=false", "dtype=float32",
                               f"capacity_factor={capacity_factor}", "matmul_precision=highest"])
  return moe.RoutedMoE(cfg, inits.VariableFactory(weight_dtype="float32", seed=0)), cfg


def _reference(block, x, weights, idx, capacity_factor):
  x, weights, idx = (np.asarray(a, np.float64) for a in (x, weights, idx))
  idx = idx.astype(int)
  w0, w1, wo = (np.asarray(v[...], np.float64) for v in (block.wi_0, block.wi_1, block.wo))
  b, s, k = idx.shape
  capacity = s * k if capacity_factor is None else int(
      max(math.ceil(s * k / block.num_experts) * capacity_factor, capacity_factor))
  out, dropped = np.zeros(x.shape), 0
  for row in range(b):
    taken = np.zeros(block.num_experts, int)
    for pos in range(s):
      for slot in range(k):
        e = idx[row, pos, slot]
        taken[e] += 1
        if taken[e] > capacity:
          dropped += 1
          continue
        h = x[row, pos] @ w0[e]
        h = h / (1 + np.exp(-h)) * (x[row, pos] @ w1[e])
        out[row, pos] += weights[row, pos, slot] * (h @ wo[e])
  return out, dropped


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_token_dropping_matches_the_numpy_reference(capacity_factor):
  block, cfg = _moe(capacity_factor)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 24, cfg.emb_dim), jnp.float32)
  weights, idx = block.route(*block.gate(x))
  ours = np.asarray(block(x), np.float64)
  want, dropped = _reference(block, x, weights, idx, capacity_factor)
  err = np.linalg.norm(ours - want) / np.linalg.norm(want)
  assert err < 1e-5, err  # measured ~3e-7 (float32 sums)
  if capacity_factor <= 1.0:
    assert dropped > 0  # the case really drops tokens
    full, _ = _reference(block, x, weights, idx, None)
    assert np.linalg.norm(ours - full) / np.linalg.norm(full) > 0.05


def test_no_capacity_factor_drops_nothing():
  block, cfg = _moe(-1.0)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 24, cfg.emb_dim), jnp.float32)
  weights, idx = block.route(*block.gate(x))
  want, dropped = _reference(block, x, weights, idx, None)
  assert dropped == 0
  err = np.linalg.norm(np.asarray(block(x), np.float64) - want) / np.linalg.norm(want)
  assert err < 1e-5, err
