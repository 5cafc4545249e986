"""Benchmarks `inspect_checkpoint export` (fp8_full) on >= 1 GB MaxText-layout Orbax checkpoints written for it.

For each source checkpoint: the export process (`python -m inspect_tool export ... --no-validate`, and for the
first checkpoint again with validation): wall time and peak RSS (/usr/bin/time), against the checkpoint's size
and its largest array, and the export's throughput (source bytes / wall seconds) as a ratio to copying the same
checkpoint directory (`cp -r`, page cache warm for both). A process that only imports and plans (traces the
rules) gives the RSS floor. The two default checkpoints share their largest array (the 265 MB embedding) but
differ 1.8x in size (scanned 4 layers, 1.36 GB; unscanned 9 layers, 2.39 GB): streaming shows as a peak RSS that
follows the largest array, not the checkpoint.

  .venv/bin/python bench/bench_export.py [--dir /tmp] [--only scanned|unscanned] [--keep]

Sources have random weights and are written one array at a time (`quant.ptq_weights.OrbaxStreamWriter`), so the
benchmark itself needs about one array's worth of memory. Everything is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_emb_dim=512",
         "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=64", "first_num_dense_layers=1"]
VARIANTS = {"scanned": ["base_num_decoder_layers=4"],
            "unscanned": ["base_num_decoder_layers=9", "scan_layers=false"]}
QUANT = ["quantization=fp8_full", "quantize_mtp=true"]

_PLAN_ONLY = r"""
import sys
from inspect_tool import config
from inspect_tool.fp8_export import plan as export_plan
plan = export_plan.plan_export(config.resolve_config(sys.argv[1:]))
print(len(plan.weights))
"""


def write_source(step_dir: str, tokens: list[str]) -> tuple[int, int]:
  """Random float32 weights for every leaf of the model, one array per Orbax partial save.

  Returns (logical bytes, largest array bytes).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  from inspect_tool import config, tree  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import plan as export_plan  # pylint: disable=import-outside-toplevel
  from quant import ptq_weights as qexport  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  writer = qexport.OrbaxStreamWriter(step_dir, flush_bytes=1)  # every array is its own partial save
  total = largest = 0
  for leaf in export_plan.model_leaves(config.resolve_config(tokens)):
    if leaf.key[-1] == "scale":
      array = np.ones(leaf.shape, np.float32)
    elif leaf.key[-1] == "bias":
      array = np.zeros(leaf.shape, np.float32)
    else:
      fan_in = leaf.shape[0] if len(leaf.shape) > 1 else 1
      array = rng.standard_normal(leaf.shape, dtype=np.float32)
      array *= 1.0 / np.sqrt(fan_in)
    writer.add(tree.param_key(leaf.module_path), array)  # converter layout: gate bias under params/params
    total += array.nbytes
    largest = max(largest, array.nbytes)
    del array
  writer.finalize()
  return total, largest


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def _timed(cmd: list[str], env) -> tuple[float, float, str]:
  """Wall seconds, peak RSS (bytes) and stdout of one process, from /usr/bin/time."""
  out = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True, env=env,
                       cwd=REPO, check=False)
  line = [l for l in out.stderr.splitlines() if l.startswith("TIME ")][-1]
  if out.returncode not in (0, 1):
    raise RuntimeError(f"{' '.join(cmd[:6])} ... failed: {out.stderr[-2000:]}")
  _, wall, rss_kb = line.split()
  return float(wall), int(rss_kb) * 1024, out.stdout


def bench_variant(root: str, name: str, tokens: list[str], env, *, validate: bool) -> dict:
  """Writes one source checkpoint and measures copy and export on it."""
  out: dict = {"model": tokens + QUANT}
  source = os.path.join(root, name)
  start = time.perf_counter()
  logical, largest = write_source(os.path.join(source, "0"), tokens)
  on_disk = _du(source)
  out["source"] = {"logical_bytes": logical, "on_disk_bytes": on_disk, "largest_array_bytes": largest,
                   "write_seconds": round(time.perf_counter() - start, 2)}
  print(f"[{name}] source: {logical / 1e9:.2f} GB float32 ({on_disk / 1e9:.2f} GB on disk), largest array "
        f"{largest / 1e6:.0f} MB; written in {out['source']['write_seconds']} s")

  subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat"]
                 + [os.path.join(r, f) for r, _, fs in os.walk(source) for f in fs], check=True)  # warm cache
  start = time.perf_counter()
  subprocess.run(["cp", "-r", source, os.path.join(root, "copy")], check=True)
  copy_s = time.perf_counter() - start
  shutil.rmtree(os.path.join(root, "copy"))
  out["copy_seconds"] = round(copy_s, 3)
  print(f"[{name}] cp -r: {copy_s:.2f} s = {on_disk / copy_s / 1e9:.2f} GB/s")

  plan_s, plan_rss, _ = _timed([sys.executable, "-c", _PLAN_ONLY] + tokens + QUANT, env)
  out["floor"] = {"wall_seconds": plan_s, "peak_rss_bytes": plan_rss}
  print(f"[{name}] floor (imports + rule trace, no arrays): {plan_s:.1f} s, peak RSS {plan_rss / 1e6:.0f} MB")

  runs = {}
  for label, extra in (("export --no-validate", ["--no-validate"]), ("export with validation", [])):
    if not validate and not extra:
      continue
    dst = os.path.join(root, "out")
    cmd = [sys.executable, "-m", "inspect_tool", "export", *tokens, *QUANT, "--checkpoint", source, "--output",
           dst, "--overwrite", "--format", "json", *extra]
    wall, rss, stdout = _timed(cmd, env)
    report = json.loads(stdout)
    written = report["bytes"]["written"]
    r = runs[label] = {
        "wall_seconds": wall, "peak_rss_bytes": rss, "written_bytes": written,
        "rss_over_checkpoint": round(rss / logical, 3), "rss_over_largest_array": round(rss / largest, 2),
        "rss_above_floor_over_largest_array": round((rss - plan_rss) / largest, 2),
        "throughput_bytes_per_s": round(logical / wall), "throughput_ratio_to_copy": round(copy_s / wall, 3)}
    if not extra:
      r["validation_passed"] = report["validation"]["passed"]
      r["vs_quantized_source"] = report["validation"]["vs_quantized_source"]
    print(f"[{name}] {label}: {wall:.1f} s, peak RSS {rss / 1e6:.0f} MB = {r['rss_over_checkpoint']:.2f} x "
          f"checkpoint = {r['rss_over_largest_array']:.1f} x largest array "
          f"({r['rss_above_floor_over_largest_array']:.1f} x above the floor); {logical / 1e9:.2f} GB -> "
          f"{written / 1e9:.2f} GB; throughput {logical / wall / 1e9:.3f} GB/s = "
          f"{r['throughput_ratio_to_copy']:.3f} x cp -r")
    shutil.rmtree(dst, ignore_errors=True)
  out["runs"] = runs
  shutil.rmtree(source, ignore_errors=True)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="where to write (default: system temp)")
  parser.add_argument("--only", choices=sorted(VARIANTS), help="benchmark one source checkpoint only")
  parser.add_argument("--keep", action="store_true", help="keep the work directory (sources are removed)")
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="bench_export_", dir=args.dir)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  results = {}
  try:
    names = [args.only] if args.only else list(VARIANTS)
    for i, name in enumerate(names):
      results[name] = bench_variant(root, name, MODEL + VARIANTS[name], env, validate=i == 0)
    print(json.dumps(results, indent=1))
  finally:
    if args.keep:
      print(f"kept {root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
