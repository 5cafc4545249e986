"""How far two sets of logits are apart: cosine similarity, top-1 agreement, KL divergence, relative error.

Used by `forward --compare` (unquantized vs quantized) and by export validation (source vs exported).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class HeadComparison:
  """Agreement of one head's logits (B, S, V) between a reference and a candidate run."""

  head: str  # "main" or "mtp_1", "mtp_2", ...
  cosine: float  # mean over positions of the cosine similarity of the logit vectors
  top1_agreement: float  # share of positions whose argmax agrees
  kl: float  # mean over positions of KL(reference || candidate) of the softmax distributions, in nats
  rel_error: float  # ||candidate - reference|| / ||reference|| over the whole array
  positions: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(head: str, reference, candidate, mask=None) -> HeadComparison:
  """Compares two logits arrays of the same shape (..., V); `mask` (...) selects the positions counted."""
  ref = np.asarray(reference, np.float64)
  cand = np.asarray(candidate, np.float64)
  if ref.shape != cand.shape:
    raise ValueError(f"logits shapes differ: {ref.shape} vs {cand.shape}")
  ref2 = ref.reshape(-1, ref.shape[-1])
  cand2 = cand.reshape(-1, cand.shape[-1])
  keep = np.ones(len(ref2), bool) if mask is None else np.asarray(mask).reshape(-1).astype(bool)
  ref2, cand2 = ref2[keep], cand2[keep]
  cos = (ref2 * cand2).sum(-1) / np.maximum(np.linalg.norm(ref2, axis=-1) * np.linalg.norm(cand2, axis=-1), 1e-30)
  log_p, log_q = _log_softmax(ref2), _log_softmax(cand2)
  kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
  rel = np.linalg.norm(cand2 - ref2) / max(np.linalg.norm(ref2), 1e-30)
  return HeadComparison(head, float(cos.mean()), float((ref2.argmax(-1) == cand2.argmax(-1)).mean()),
                        float(kl.mean()), float(rel), int(keep.sum()))


def compare_heads(reference, candidate) -> list[HeadComparison]:
  """Compares the main head and each MTP depth of two forward results (objects with logits / mtp_logits)."""
  out = [compare_logits("main", reference.logits, candidate.logits)]
  if getattr(reference, "mtp_logits", None) is not None and getattr(candidate, "mtp_logits", None) is not None:
    for depth in range(np.asarray(reference.mtp_logits).shape[0]):
      out.append(compare_logits(f"mtp_{depth + 1}", reference.mtp_logits[depth], candidate.mtp_logits[depth]))
  return out


def format_comparisons(rows: list[HeadComparison]) -> str:
  lines = [f"{'head':8s} {'cosine':>8s} {'top-1 agree':>12s} {'KL (nats)':>10s} {'rel err':>8s}"]
  for r in rows:
    lines.append(f"{r.head:8s} {r.cosine:8.5f} {r.top1_agreement:12.4f} {r.kl:10.5f} {r.rel_error:8.4f}")
  return "\n".join(lines) + "\n"
