"""Benchmarks checkpoint I/O on a >= 2 GB MaxText-layout Orbax checkpoint written for the purpose.

Measures (a) the whole `inspect_checkpoint orbax --path` process (wall time and peak RSS, median of 5;
metadata only, so both must stay flat as checkpoints grow: targets <= 1.5 s and <= 300 MB), and (b) the
throughput of restoring every array onto the device mesh against `cat` of the same files (page cache warm
for both; `cat` runs first to warm it).

  python bench/bench_checkpoint.py [--experts 40] [--dir /tmp] [--keep] [--tiny]

`--tiny` (a smoke run, seconds): a ~10 MB checkpoint of the same layout (every size / 8 or less, 4 experts, one
MoE layer), one timed run.

The checkpoint is written one array at a time (Orbax partial saves) so the benchmark itself needs about
one array's worth of memory, and it is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A scaled DeepSeek-V3 layout (scanned, layer axis at 1, MTP depth 1); sizes chosen for ~2.2 GB float32.
Dims = collections.namedtuple("Dims", "E V H QR KR DN DR DV F FM")
FULL = Dims(1024, 32768, 16, 384, 256, 128, 64, 128, 4096, 512)
TINY = Dims(128, 4096, 2, 48, 32, 16, 8, 16, 512, 64)


def _attention(n: int | None, d: Dims) -> dict[str, tuple[int, ...]]:
  E, H, QR, KR, DN, DR, DV = d.E, d.H, d.QR, d.KR, d.DN, d.DR, d.DV  # pylint: disable=invalid-name
  def s(*dims):  # insert the layer axis at index 1 for scanned stacks
    return dims[:1] + (n,) + dims[1:] if n else dims
  return {
      "pre_self_attention_layer_norm/scale": s(E), "post_self_attention_layer_norm/scale": s(E),
      "self_attention/wq_a/kernel": s(E, QR), "self_attention/q_norm/scale": s(QR),
      "self_attention/wq_b/kernel": s(QR, H, DN + DR), "self_attention/wkv_a/kernel": s(E, KR + DR),
      "self_attention/kv_norm/scale": s(KR), "self_attention/wkv_b/kernel": s(KR, H, DN + DV),
      "self_attention/out/kernel": s(H, DV, E),
  }


def _moe(n: int | None, experts: int, d: Dims) -> dict[str, tuple[int, ...]]:
  E, FM = d.E, d.FM  # pylint: disable=invalid-name
  def s(*dims):
    return dims[:1] + (n,) + dims[1:] if n else dims
  block = "DeepSeekMoeBlock_0/"
  out = _attention(n, d)
  out.update({
      block + "MoeBlock_0/gate/kernel": s(E, experts),
      block + "MoeBlock_0/gate/bias": (n, experts) if n else (experts,),
      block + "MoeBlock_0/wi_0": s(experts, E, FM), block + "MoeBlock_0/wi_1": s(experts, E, FM),
      block + "MoeBlock_0/wo": s(experts, FM, E), block + "shared_experts/wi_0/kernel": s(E, FM),
      block + "shared_experts/wi_1/kernel": s(E, FM), block + "shared_experts/wo/kernel": s(FM, E),
  })
  return out


def param_shapes(experts: int = 40, moe_layers: int = 6, d: Dims = FULL) -> dict[str, tuple[int, ...]]:
  """Module path -> shape of the benchmark model (converter layout: gate bias inside params)."""
  E, V, F = d.E, d.V, d.F  # pylint: disable=invalid-name
  shapes = {"token_embedder/embedding": (V, E), "decoder/decoder_norm/scale": (E,),
            "decoder/logits_dense/kernel": (E, V)}
  dense = _attention(1, d)
  dense.update({"mlp/wi_0/kernel": (E, 1, F), "mlp/wi_1/kernel": (E, 1, F), "mlp/wo/kernel": (F, 1, E)})
  shapes.update({"decoder/dense_layers/" + k: v for k, v in dense.items()})
  shapes.update({"decoder/moe_layers/" + k: v for k, v in _moe(moe_layers, experts, d).items()})
  mtp = "mtp_block/mtp_layer_1/"
  shapes.update({mtp + "mtp_1_embedding_norm/scale": (E,), mtp + "mtp_1_hidden_state_norm/scale": (E,),
                 mtp + "mtp_1_final_norm/scale": (E,), mtp + "mtp_1_projection/kernel": (2 * E, E)})
  shapes.update({mtp + "mtp_1_transformer_layer/" + k: v for k, v in _moe(None, experts, d).items()})
  return shapes


def write_checkpoint(step_dir: str, shapes: dict[str, tuple[int, ...]]) -> int:
  """Writes random float32 arrays one partial save at a time; returns the logical bytes written."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint.experimental.v1 as ocp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  total = 0
  for i, (path, shape) in enumerate(sorted(shapes.items())):
    node = tree = {}
    parts = ["params", "params"] + path.split("/")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    array = rng.random(shape, dtype=np.float32)
    array -= 0.5
    node[parts[-1]] = jax.device_put(array)
    del array
    ocp.partial.save(step_dir, tree)
    total += int(np.prod(shape)) * 4
    if sys.stderr.isatty():
      print(f"\r  wrote {i + 1}/{len(shapes)} arrays, {total / 1e9:.2f} GB", end="", file=sys.stderr)
  ocp.partial.save(step_dir, {"step": 0})
  ocp.partial.finalize(step_dir)
  if sys.stderr.isatty():
    print(file=sys.stderr)
  # Partial saves use the checkpointable name 'state'; MaxText's is 'items'.
  os.rename(os.path.join(step_dir, "state"), os.path.join(step_dir, "items"))
  return total


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def _timed(cmd: list[str], env=None) -> tuple[float, float]:
  """Wall seconds and peak RSS (MB) of one process, from /usr/bin/time."""
  out = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True, env=env,
                       cwd=REPO, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-1000:]}")
  line = [l for l in out.stderr.splitlines() if l.startswith("TIME ")][-1]
  _, wall, rss_kb = line.split()
  return float(wall), int(rss_kb) / 1024


def _cli_available() -> bool:
  out = subprocess.run([sys.executable, "-m", "inspect_tool", "orbax", "--help"], capture_output=True, cwd=REPO,
                       check=False)
  return out.returncode == 0


_RESTORE = r"""
import sys, time
start = time.perf_counter()
import jax
import orbax.checkpoint  # imported before timing: the figure is the data rate, not the import
import tensorstore as ts
from inspect_tool.checkpoint import orbax_metadata, restore
imports = time.perf_counter() - start
listing = orbax_metadata.read_listing(sys.argv[1])
leaves = [l for l in listing.leaves if l.is_param]
times = []
for _ in range(2):  # the first pass also pays for fresh process memory (first-touch page faults)
  start = time.perf_counter()
  arrays = restore.restore_leaves(sys.argv[1], leaves)
  jax.block_until_ready(list(arrays.values()))
  times.append(time.perf_counter() - start)
  nbytes = sum(a.nbytes for a in arrays.values())
  del arrays
# The floor for any reader of this format: tensorstore alone, every array at once, into host memory.
store = {"driver": "ocdbt", "base": "file://" + listing.resolved.items_dir + "/"}
start = time.perf_counter()
opened = [ts.open({"driver": "zarr3", "kvstore": store, "path": ".".join(listing.raw_keys[l.key]) + "/"})
          for l in leaves]
reads = [f.result().read() for f in opened]
raw = sum(r.result().nbytes for r in reads)
ts_seconds = time.perf_counter() - start
print(nbytes, times[0], times[1], imports, raw, ts_seconds)
"""


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: system temp)")
  parser.add_argument("--experts", type=int, default=40, help="routed experts (40 gives ~2.2 GB)")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
  parser.add_argument("--tiny", action="store_true", help="smoke run: a ~10 MB checkpoint, one timed run")
  args = parser.parse_args()
  if args.tiny:
    args.runs = 1
  shapes = (param_shapes(experts=4, moe_layers=1, d=TINY) if args.tiny else param_shapes(experts=args.experts))
  need = sum(4 * math.prod(s) for s in shapes.values())
  root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
  free = shutil.disk_usage(root).free
  if free < 2.5 * need:
    shutil.rmtree(root)
    print(f"not enough disk under {root}: {free / 1e9:.1f} GB free, need {2.5 * need / 1e9:.1f} GB", file=sys.stderr)
    return 1
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  try:
    step_dir = os.path.join(root, "checkpoints", "0")
    os.makedirs(os.path.dirname(step_dir))
    start = time.perf_counter()
    logical = write_checkpoint(step_dir, shapes)
    on_disk = _du(step_dir)
    print(f"checkpoint: {len(shapes)} arrays, {logical / 1e9:.2f} GB float32, {on_disk / 1e9:.2f} GB on disk, "
          f"written in {time.perf_counter() - start:.1f} s ({step_dir})")

    runs = []
    if _cli_available():
      runs.append(("inspect_checkpoint orbax --path", [sys.executable, "-m", "inspect_tool", "orbax", "--path",
                                                       os.path.dirname(step_dir)]))
    else:
      print("(CLI `python -m inspect_tool orbax` not available: measuring the library call only)")
    runs.append(("orbax_metadata.read_leaves (python -c)", [
        sys.executable, "-c", "import sys; from inspect_tool.checkpoint import orbax_metadata as m; "
        "print(len(m.read_leaves(sys.argv[1])))", step_dir]))
    for label, cmd in runs:
      _timed(cmd, env)  # warm the page cache and the bytecode cache
      samples = [_timed(cmd, env) for _ in range(args.runs)]
      wall = statistics.median(s[0] for s in samples)
      rss = statistics.median(s[1] for s in samples)
      print(f"(a) {label}: median of {args.runs}: {wall:.2f} s wall, {rss:.0f} MB peak RSS "
            f"(target <= 1.5 s, <= 300 MB)")

    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs]
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat"] + files
    subprocess.run(cat, check=True)  # warm
    start = time.perf_counter()
    subprocess.run(cat, check=True)
    cat_s = time.perf_counter() - start
    out = subprocess.run([sys.executable, "-c", _RESTORE, step_dir], capture_output=True, text=True, env=env,
                         cwd=REPO, check=False)
    if out.returncode != 0:
      raise RuntimeError(f"restore failed: {out.stderr[-2000:]}")
    restored, first_s, again_s, import_s, raw, ts_s = out.stdout.split()
    restored, first_s, again_s, import_s = int(restored), float(first_s), float(again_s), float(import_s)
    cat_rate, ts_rate = on_disk / cat_s, int(raw) / float(ts_s)
    first_rate, again_rate = restored / first_s, restored / again_s
    print(f"(b) cat (warm cache): {on_disk / 1e9:.2f} GB in {cat_s:.2f} s = {cat_rate / 1e9:.2f} GB/s")
    print(f"    restore all arrays onto the mesh (first, fresh process memory): {restored / 1e9:.2f} GB in "
          f"{first_s:.2f} s = {first_rate / 1e9:.2f} GB/s; ratio restore/cat = {first_rate / cat_rate:.3f}")
    print(f"    restore again in the same process: {again_s:.2f} s = {again_rate / 1e9:.2f} GB/s "
          f"({on_disk / again_s / 1e9:.2f} GB/s of files); ratio restore/cat = {again_rate / cat_rate:.3f}")
    print(f"    (jax+orbax import {import_s:.2f} s not included; tensorstore alone, the zstd-decoding floor of "
          f"this format: {ts_rate / 1e9:.2f} GB/s, ratio restore/tensorstore = {again_rate / ts_rate:.2f})")
  finally:
    if args.keep:
      print(f"kept {root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
