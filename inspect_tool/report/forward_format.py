"""Formats a forward pass: losses, MTP loss per depth, top-1 predictions, and the optional comparison."""

from __future__ import annotations

import io
import json

import numpy as np

from inspect_tool.output import atomic
from quant import metrics

SCHEMA_VERSION = 1
_SHOWN_TOKENS = 16


def _float(x):
  return None if x is None else float(np.asarray(x))


def to_dict(result, *, source: str, quantization: str, comparisons=(), grad=None, weights: str | None = None,
            compared: str | None = None) -> dict:
  """The pass as JSON data; `weights` says which weights ran (`run.weights.Weights.label`; added within version 1)."""
  data = {
      "schema_version": SCHEMA_VERSION, "model": source, "weights": weights, "quantization": quantization or None,
      "batch_shape": list(np.asarray(result.logits).shape[:2]),
      "loss": _float(result.loss), "mtp_loss": _float(result.mtp_loss), "total_loss": _float(result.total_loss),
      "mtp_per_depth": [], "top1": np.asarray(result.top1).tolist(),
  }
  if result.mtp_losses is not None:
    losses, counts = np.asarray(result.mtp_losses), np.asarray(result.mtp_weights)
    data["mtp_per_depth"] = [{"depth": k + 1, "xent_sum": float(l), "tokens": float(w),
                              "mean_xent": float(l / w) if w else None} for k, (l, w) in enumerate(zip(losses, counts))]
    data["mtp_top1"] = np.asarray(result.mtp_top1).tolist()
  if comparisons:
    data["compare_unquantized_vs_quantized"] = [c.to_dict() for c in comparisons]
    if compared:
      data["compared"] = compared
  if grad is not None:
    data["gradient"] = {"loss": grad[0], "global_norm": grad[1], "finite": grad[2]}
  return data


def format_json(result, **kwargs) -> str:
  return json.dumps(to_dict(result, **kwargs), indent=2) + "\n"


def format_text(result, *, source: str, quantization: str, comparisons=(), grad=None, weights: str | None = None,
                compared: str | None = None) -> str:
  batch, seq = np.asarray(result.logits).shape[:2]
  lines = [f"model: {source}"] + ([f"weights: {weights}"] if weights else []) + [
      f"quantization: {quantization or 'none'}", f"batch: {batch} x {seq} tokens"]
  if result.loss is not None:
    lines.append(f"main loss: {float(result.loss):.6f}")
  if result.mtp_losses is not None:
    for k, (l, w) in enumerate(zip(np.asarray(result.mtp_losses), np.asarray(result.mtp_weights))):
      mean = f"{l / w:.6f}" if w else "n/a"
      lines.append(f"mtp depth {k + 1}: mean xent {mean} (sum {l:.4f} over {w:.0f} tokens)")
    lines.append(f"mtp loss (scaled): {float(result.mtp_loss):.6f}")
    lines.append(f"total loss: {float(result.total_loss):.6f}")
  top1 = np.asarray(result.top1)
  for row in range(batch):
    more = " ..." if seq > _SHOWN_TOKENS else ""
    lines.append(f"top-1 row {row}: {' '.join(map(str, top1[row, :_SHOWN_TOKENS]))}{more}")
  if result.mtp_top1 is not None:
    mtp_top1 = np.asarray(result.mtp_top1)
    for k in range(mtp_top1.shape[0]):
      more = " ..." if seq > _SHOWN_TOKENS else ""
      lines.append(f"mtp {k + 1} top-1 row 0: {' '.join(map(str, mtp_top1[k, 0, :_SHOWN_TOKENS]))}{more}")
  if grad is not None:
    lines.append(f"gradient: loss {grad[0]:.6f}, global norm {grad[1]:.6g}, finite {grad[2]}")
  text = "\n".join(lines) + "\n"
  if comparisons:
    text += (f"\ncompared: {compared}\n" if compared else "\n") + "unquantized (reference) vs quantized:\n"
    text += metrics.format_comparisons(list(comparisons))
  return text


def save_logits(path: str, result, *, overwrite: bool = False) -> None:
  """Writes `logits` (B,S,V) float32 and, with MTP, `mtp_logits` (depth,B,S,V) to an .npz, atomically."""
  arrays = {"logits": np.asarray(result.logits, np.float32), "top1": np.asarray(result.top1)}
  if result.mtp_logits is not None:
    arrays["mtp_logits"] = np.asarray(result.mtp_logits, np.float32)
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  atomic.atomic_write_bytes(path, buffer.getvalue(), overwrite=overwrite)
