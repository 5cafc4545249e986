"""Benchmarks `inspect_checkpoint export` beside Orbax's own restore + save of the same source, in one run.

For each source checkpoint (float32, MaxText converter layout, chunked in 16 MB blocks as a checkpoint written by
many devices is; `tests/export_sources.py`): wall time and peak RSS (/usr/bin/time) of
  * Orbax: `orbax.checkpoint.PyTreeCheckpointer` restore of the whole pytree, then save to a new directory;
  * `export --no-validate` with the default --max-memory (half of the available memory: big slices);
  * `export --no-validate --max-memory M` (bounded; for `embedding` M is under half its largest array): the arrays
    of both exports are compared byte for byte afterwards;
  * `export --layout deepseek-fp8` (Hugging Face FP8 safetensors), for the first source, with the default
    --max-memory and with the bounded one (its peak RSS printed beside it).
Every case runs `--repeat` times (default 3), the cases interleaved round by round and each started after `sync`
(no earlier run's write-back under way); the median wall time is reported with the range, the peak RSS is the
largest. Ratios are export / Orbax (medians). The last lines extrapolate a 671B export (DeepSeek-V3 MaxText
checkpoint, 671e9 float32 parameters = 2.68 TB read) from the bounded export's throughput: one host like this one,
and 16 such hosts (each process writes 1/16 of the slices; the merge of per-process databases is metadata only).

  .venv-py3.12/bin/python bench/bench_export.py [--dir /tmp] [--only scanned|embedding] [--repeat 3] [--keep]

`--tiny` (a smoke run, seconds): the 5.6 MB 4-layer deepseek3-tiny source only, one round, no deepseek-fp8 cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
MODEL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_emb_dim=512",
         "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=64", "first_num_dense_layers=1"]
# scanned: 1.36 GB, experts (64, 3, 512, 512) 201 MB each; embedding: 1.58 GB with a 1.26 GB (tied) embedding.
VARIANTS = {
    "scanned": (MODEL + ["base_num_decoder_layers=4"], "1GB"),
    "embedding": (["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=512",
                   "vocab_size=614400", "logits_via_embedding=true", "base_moe_mlp_dim=256", "base_mlp_dim=1024",
                   "num_experts=64", "base_num_decoder_layers=4", "first_num_dense_layers=1"], "600MB"),
}
TINY = (["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
         "first_num_dense_layers=1", "vocab_size=1024"], "600MB")
QUANT = ["quantization=fp8_full"]
PARAMS_671B = 671e9

_ORBAX = r"""
import sys
import orbax.checkpoint as ocp
with ocp.PyTreeCheckpointer() as c:
  tree = c.restore(sys.argv[1])
  c.save(sys.argv[2], tree)
"""


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


def _same_arrays(a: str, b: str) -> bool:
  """Every array of two Orbax exports equal byte for byte (read by tensorstore in 16-row blocks)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  def stores(path):
    base = {"driver": "file", "path": os.path.join(path, "0", "items") + "/"}
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    names = {k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")}
    return {n: ts.open({"driver": "zarr3", "kvstore": dict(driver="ocdbt", base=base, path=n + "/")},
                       open=True).result() for n in names}

  x, y = stores(a), stores(b)
  if sorted(x) != sorted(y):
    return False
  for name, store in x.items():
    rows = store.shape[0] if store.shape else 1
    step = max(1, rows // 16)
    for start in range(0, rows, step):
      index = (slice(start, start + step),) if store.shape else ()
      if np.asarray(store[index].read().result()).tobytes() != np.asarray(y[name][index].read().result()).tobytes():
        return False
  return True


def bench_variant(root: str, name: str, tokens: list[str], bound: str, env, *, hf: bool, repeat: int) -> dict:
  """Writes one source checkpoint and measures Orbax and the exports on it, `repeat` interleaved rounds."""
  import export_sources  # pylint: disable=import-outside-toplevel

  out: dict = {"model": tokens + QUANT}
  source = os.path.join(root, name, "0")
  start = time.perf_counter()
  logical, largest = export_sources.write_source(source, tokens)
  out["source"] = {"bytes": logical, "largest_array_bytes": largest, "on_disk_bytes": _du(source),
                   "write_seconds": round(time.perf_counter() - start, 2)}
  print(f"[{name}] source: {logical / 1e9:.2f} GB float32, largest array {largest / 1e6:.0f} MB")
  subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat"]
                 + [os.path.join(r, f) for r, _, fs in os.walk(source) for f in fs], check=True)  # warm cache

  cases = [("orbax restore+save", None, "orbax"), ("export", [], "unbounded"),
           (f"export --max-memory {bound}", ["--max-memory", bound], "bounded")]
  if hf:
    cases.append(("export --layout deepseek-fp8", ["--layout", "deepseek-fp8"], "hf"))
    cases.append((f"deepseek-fp8 --max-memory {bound}", ["--layout", "deepseek-fp8", "--max-memory", bound],
                  "hf_bounded"))
  samples: dict[str, list] = {label: [] for label, _, _ in cases}
  for round_ in range(repeat):  # the cases interleaved, each round in the same order; medians reported
    for label, extra, dst_name in cases:
      dst = os.path.join(root, dst_name)
      shutil.rmtree(dst, ignore_errors=True)
      if extra is None:
        cmd = [sys.executable, "-c", _ORBAX, os.path.join(source, "items"), dst]
      else:
        cmd = [sys.executable, "-m", "inspect_tool", "export", *tokens, *QUANT, "--checkpoint", source, "--output",
               dst, "--format", "json", "--no-validate", "--quiet", *extra]
      os.sync()  # every run starts without the previous one's dirty pages still being written back
      samples[label].append(_timed(cmd, env)[:2])
      if extra is None or round_ < repeat - 1:
        shutil.rmtree(dst, ignore_errors=True)  # the last exports are compared below
  runs = {}
  for label, got in samples.items():
    walls = [w for w, _ in got]
    runs[label] = {"wall_seconds": statistics.median(walls), "wall_seconds_runs": walls,
                   "peak_rss_bytes": max(r for _, r in got)}
  bounded_label = cases[2][0]
  out["bounded_equals_unbounded"] = _same_arrays(os.path.join(root, "unbounded"), os.path.join(root, "bounded"))
  orbax_s = runs["orbax restore+save"]["wall_seconds"]
  for label, r in runs.items():
    r["time_ratio_to_orbax"] = round(r["wall_seconds"] / orbax_s, 3)
    r["throughput_bytes_per_s"] = round(logical / r["wall_seconds"])
    spread = f"{min(r['wall_seconds_runs']):.1f}-{max(r['wall_seconds_runs']):.1f}"
    print(f"[{name}] {label:34s} {r['wall_seconds']:7.1f} s ({spread})  peak RSS {r['peak_rss_bytes'] / 1e6:6.0f} MB"
          f"  {r['time_ratio_to_orbax']:.2f} x Orbax's time  {logical / r['wall_seconds'] / 1e6:.0f} MB/s")
  print(f"[{name}] bounded export (peak RSS {runs[bounded_label]['peak_rss_bytes'] / 1e6:.0f} MB, largest array "
        f"{largest / 1e6:.0f} MB) equals the unbounded one byte for byte: {out['bounded_equals_unbounded']}")
  if hf:
    for label in cases[3:]:
      r = runs[label[0]]
      print(f"[{name}] {label[0]}: peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB (--max-memory "
            f"{label[1][-1] if '--max-memory' in label[1] else 'default'}); throughput "
            f"{orbax_s / r['wall_seconds']:.2f} x Orbax restore+save's")
  rate = runs[bounded_label]["throughput_bytes_per_s"]
  one = PARAMS_671B * 4 / rate
  out["extrapolated_671b_seconds"] = {"one_host": round(one), "16_hosts": round(one / 16)}
  print(f"[{name}] 671B (2.68 TB float32) at {rate / 1e6:.0f} MB/s: one host {one / 3600:.1f} h, 16 hosts "
        f"{one / 16 / 3600:.2f} h")
  out["runs"] = runs
  for d in ("unbounded", "bounded", "hf", "hf_bounded", name):
    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="where to write (default: system temp)")
  parser.add_argument("--only", choices=sorted(VARIANTS), help="benchmark one source checkpoint only")
  parser.add_argument("--keep", action="store_true", help="keep the work directory (sources are removed)")
  parser.add_argument("--repeat", type=int, default=3, help="rounds of every case, interleaved (median reported)")
  parser.add_argument("--tiny", action="store_true", help="smoke run: a 5.6 MB source, one round")
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="bench_export_", dir=args.dir)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  results = {"machine": f"{os.cpu_count()} CPUs"}
  try:
    if args.tiny:
      results["tiny"] = bench_variant(root, "tiny", *TINY, env, hf=False, repeat=1)
    names = [] if args.tiny else [args.only] if args.only else list(VARIANTS)
    for i, name in enumerate(names):
      tokens, bound = VARIANTS[name]
      results[name] = bench_variant(root, name, tokens, bound, env, hf=i == 0, repeat=args.repeat)
    print(json.dumps(results, indent=1))
  finally:
    if args.keep:
      print(f"kept {root}")
    else:
      shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
