"""Logit comparison metrics: identical logits agree perfectly; known perturbations give known values."""

import numpy as np
import pytest

from quant import metrics


def test_identical_logits():
  x = np.random.default_rng(0).normal(size=(2, 5, 11))
  r = metrics.compare_logits("main", x, x)
  assert r.cosine == pytest.approx(1.0) and r.top1_agreement == 1.0 and r.kl == pytest.approx(0.0, abs=1e-12)
  assert r.rel_error == 0.0 and r.positions == 10


def test_shifted_logits_have_zero_kl_but_changed_cosine():
  x = np.random.default_rng(1).normal(size=(4, 7))
  r = metrics.compare_logits("main", x, x + 3.0)
  assert r.kl == pytest.approx(0.0, abs=1e-12) and r.top1_agreement == 1.0 and r.cosine < 1.0


def test_swapped_argmax_counts_disagreement_and_mask():
  ref = np.array([[0.0, 1.0], [1.0, 0.0]])
  cand = np.array([[1.0, 0.0], [1.0, 0.0]])
  r = metrics.compare_logits("main", ref, cand)
  assert r.top1_agreement == 0.5
  kl_first = sum(p * np.log(p / q) for p, q in zip([1 / (1 + np.e), np.e / (1 + np.e)],
                                                   [np.e / (1 + np.e), 1 / (1 + np.e)]))
  assert r.kl == pytest.approx(kl_first / 2)
  assert metrics.compare_logits("main", ref, cand, mask=np.array([False, True])).top1_agreement == 1.0


def test_shape_mismatch_is_refused():
  with pytest.raises(ValueError, match="shapes differ"):
    metrics.compare_logits("main", np.zeros((2, 3)), np.zeros((3, 3)))
