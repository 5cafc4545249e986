"""Two exports of the same checkpoint, tensor by tensor: which stored tensors differ and by how many elements.

The manifests name every stored tensor with its sha256; a tensor whose hashes differ is read from both exports
(Orbax layout: its item directory as numpy) and its differing elements counted, with the largest difference in
units of the format's last place where both are fp8. Prints one line per differing tensor and a total.

  JAX_PLATFORMS=cpu python scripts/compare_exports.py A B
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import orbax_sources  # noqa: E402  pylint: disable=wrong-import-position


def _hashes(path: str) -> dict[str, str]:
  with open(os.path.join(path, "export_manifest.json"), encoding="utf-8") as f:
    return {t["name"]: t["sha256"] for t in json.load(f)["tensors"]}


def _flat(tree, prefix=()):
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _flat(value, prefix + (str(key),))
  else:
    yield ".".join(prefix), tree


def main(a: str, b: str) -> int:
  ha, hb = _hashes(a), _hashes(b)
  if set(ha) != set(hb):
    print(f"the exports store different tensors: {sorted(set(ha) ^ set(hb))[:5]}")
    return 1
  differing = sorted(n for n in ha if ha[n] != hb[n])
  print(f"{len(ha)} tensors, {len(differing)} with differing bytes")
  if differing:
    arrays = [dict(_flat(orbax_sources.restore_numpy(os.path.join(p, "0", "items")))) for p in (a, b)]
    total = 0
    for name in differing:
      key = next(k for k in arrays[0] if name.endswith(k) or k.endswith(name.split("params.", 1)[-1]))
      x, y = np.asarray(arrays[0][key]), np.asarray(arrays[1][key])
      bytes_x, bytes_y = x.view(np.uint8).reshape(x.size, -1), y.view(np.uint8).reshape(y.size, -1)
      ne = int(np.any(bytes_x != bytes_y, axis=1).sum())
      total += ne
      print(f"  {name}: {ne} of {x.size} elements differ ({x.dtype}); largest |a-b| "
            f"{float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))):.3g}")
    print(f"elements differing in all: {total}")
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:3]))
