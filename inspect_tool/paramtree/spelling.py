"""A parameter or module named either way the tool prints it: dotted listing keys or slash module paths."""

from __future__ import annotations

# Collection prefixes of listing keys (MaxText's on-disk convention; see `paramtree.params`).
_PREFIXES = (("params", "params"), ("nnx_aux", "model"), ("params",))


def to_slash(name: str) -> str:
  """`params.params.decoder.dense_layers.self_attention.out.kernel` (a listing key), `decoder.dense_layers...` or
  `decoder/dense_layers/...` → `decoder/dense_layers/self_attention/out/kernel` (the model path)."""
  text = name.strip().strip("/")
  parts = [p for p in (text.split("/") if "/" in text else text.split(".")) if p]
  for prefix in _PREFIXES:
    if tuple(parts[:len(prefix)]) == prefix and len(parts) > len(prefix):
      parts = parts[len(prefix):]
      break
  return "/".join(parts)
