"""Benchmarks `inspect_checkpoint import` beside MaxText 0.2.5's own standalone converter, in one run.

Source: a DeepSeek-V3-shaped Hugging Face directory (float16 safetensors, one shard per layer, transformers' names;
`tests/hf_sources.py`). For each case, wall time, CPU time and peak RSS (/usr/bin/time) of one process:
  * `import` with the default --max-memory (half of the available memory), float32 output (MaxText's default);
  * `import ... weight_dtype=float16` (the converter's output dtype: the same bytes written);
  * `import --max-memory M` (bounded, float32), M = 1.5x the smallest budget the tool accepts for this directory
    (asked of the tool: its refusal line "accepted: at least X" for a 1 MB budget);
  * with `--peer PYTHON` (a MaxText 0.2.5 venv with torch): MaxText's
    `checkpoint_conversion.standalone_scripts.convert_deepseek_family_ckpt` (default 16 simulated CPU devices,
    `--enable_mtp false`), the model's sizes registered in its MODEL_PARAMS_DICT by this script's driver. It reads
    float safetensors only (it refuses the FP8 release: "fp8 checkpoint is not supported").
Every case runs `--repeat` times (default 3; 1 with --tiny), interleaved round by round; medians are printed, the
peak RSS is the largest. Ratios are ours / MaxText's. The last lines give throughput (parameters and source bytes
per second) and extrapolate the import of DeepSeek-V3's FP8 release (671B + MTP, its size computed from the
release's tensor list) on one host like this one and on 16 (each process imports 1/16 of the slices).

  .venv-py3.12/bin/python bench/bench_import.py [--peer /path/to/maxtext-venv/bin/python] [--dir /tmp] [--repeat 3]
                                                [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import _measure  # noqa: E402  pylint: disable=wrong-import-position
import hf_sources  # noqa: E402  pylint: disable=wrong-import-position

SIZES = {"full": (1024, 1536, 2048, 32, 3, 4096), "tiny": (128, 64, 256, 8, 3, 512)}  # emb, moe_mlp, mlp, X, L, V
FLOOR_FACTOR = 1.5  # the bounded case's --max-memory, in floors
PEER = "MaxText convert_deepseek_family_ckpt"
PEER_DRIVER = """
import json, sys
from maxtext.checkpoint_conversion.standalone_scripts import convert_deepseek_family_ckpt as conv
conv.MODEL_PARAMS_DICT["bench"] = json.loads(sys.argv[1])
sys.argv = ["convert", "--base_model_path", sys.argv[2], "--maxtext_model_path", sys.argv[3], "--model_size", "bench",
            "--enable_mtp", "false"]
conv.main()
"""


def release_size() -> tuple[int, int]:
  """(bytes, parameters) of DeepSeek-V3's FP8 release (671B with its MTP layer) from the release's tensor list:
  FP8 weights 1 byte plus a float32 scale per 128x128 block, bf16 elsewhere, float32 routing biases."""
  from inspect_tool.hf import names as hf_names  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])
  nbytes = params = 0
  for entry in hf_names.leaf_plan(cfg).values():
    count = math.prod(entry.shape)
    params += count
    if entry.rule.kind in (hf_names.FP8, hf_names.EXPERTS_FP8):
      per_layer = [d for axis, d in enumerate(entry.shape) if axis != entry.layer_axis]
      matrix = per_layer[1:] if entry.rule.kind == hf_names.EXPERTS_FP8 else per_layer
      out_in = (math.prod(matrix[entry.rule.n_in:]), math.prod(matrix[:entry.rule.n_in]))
      blocks = math.ceil(out_in[0] / 128) * math.ceil(out_in[1] / 128)
      nbytes += count + 4 * blocks * count // math.prod(out_in)
    else:
      nbytes += count * (4 if entry.rule.kind == hf_names.F32 else 2) * len(entry.rule.names)
  return nbytes, params


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--peer", help="Python of a MaxText 0.2.5 venv with torch (its standalone converter)")
  parser.add_argument("--dir", default=None, help="where the source and outputs go (default: a temporary dir)")
  parser.add_argument("--repeat", type=int, default=None, help="rounds of every case, interleaved (default 3)")
  parser.add_argument("--tiny", action="store_true", help="smoke run: a 2 MB model, one round")
  args = parser.parse_args()
  size = "tiny" if args.tiny else "full"
  repeat = args.repeat or (1 if args.tiny else 3)
  emb, moe_mlp, mlp, experts, layers, vocab = SIZES[size]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
      "PYTHONPATH")])))
  root = tempfile.mkdtemp(prefix="bench_import_", dir=args.dir)
  try:
    source = os.path.join(root, "hf")
    os.mkdir(source)
    source_bytes = hf_sources.write_hf_dir(source, emb, moe_mlp, mlp, experts, layers, vocab)
    params = source_bytes // 2
    ours = [sys.executable, "-m", "inspect_tool", "import", "--path", source, "--quiet"]
    floor = _measure.memory_floor(ours + ["--output", os.path.join(root, "probe")], env, cwd=REPO)
    shutil.rmtree(os.path.join(root, "probe"), ignore_errors=True)
    bound = _measure.mib(FLOOR_FACTOR * floor)
    cases = [("import (float32)", ours + ["--output", os.path.join(root, "a")]),
             ("import weight_dtype=float16", ours + ["weight_dtype=float16", "--output", os.path.join(root, "b")]),
             (f"import --max-memory {bound} (1.5x floor)", ours + ["--max-memory", bound, "--output",
                                                                   os.path.join(root, "c")])]
    if args.peer:
      sizes = {"num_layers": layers, "first_num_dense_layers": 1, "base_num_query_heads": 4, "base_emb_dim": emb,
               "num_experts": experts, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "has_mtp": False}
      cases.append((PEER, [args.peer, "-c", PEER_DRIVER, json.dumps(sizes), source, os.path.join(root, "maxtext")]))
    print(f"source: {source_bytes / 1e6:.1f} MB float16, {params / 1e6:.1f} M parameters ({size}); smallest "
          f"--max-memory import accepts: {floor / 2**20:.0f} MiB")
    samples = {name: [] for name, _ in cases}
    for _ in range(repeat):
      for name, cmd in cases:
        shutil.rmtree(cmd[-1], ignore_errors=True)
        peer_env = dict(os.environ, JAX_PLATFORMS="cpu")
        samples[name].append(_measure.timed(cmd, peer_env if name == PEER else env, cwd=REPO))
        shutil.rmtree(cmd[-1], ignore_errors=True)
    results = {name: _measure.summary(runs) for name, runs in samples.items()}
    peer = results.pop(PEER, None)
    print(f"{'case':40s} {'wall s':>8s} {'CPU s':>8s} {'peak MB':>8s}"
          + (f" {'time ratio':>10s} {'RSS ratio':>10s}" if peer else ""))
    for name, r in results.items():
      wall, rss = r["wall_seconds"], r["peak_rss_bytes"]
      ratio = f" {wall / peer['wall_seconds']:9.2f}x {rss / peer['peak_rss_bytes']:9.2f}x" if peer else ""
      print(f"{name:40s} {wall:8.2f} {r['cpu_seconds']:8.2f} {rss / 1e6:8.0f}{ratio}")
    if peer:
      print(f"{PEER:40s} {peer['wall_seconds']:8.2f} {peer['cpu_seconds']:8.2f} {peer['peak_rss_bytes'] / 1e6:8.0f}")
    bounded = results[cases[2][0]]["peak_rss_bytes"]
    print(f"bounded import: peak RSS {bounded / 1e6:.0f} MB = {bounded / (floor * FLOOR_FACTOR):.2f} x its "
          f"--max-memory; medians of {repeat}")
    wall = results["import (float32)"]["wall_seconds"]
    rate = params / wall
    print(f"[{size}] import throughput: {source_bytes / wall / 1e6:.1f} MB/s of float16 source, "
          f"{rate / 1e6:.2f} M parameters/s")
    release_bytes, release_params = release_size()
    one = release_params / rate / 3600
    print(f"DeepSeek-V3 FP8 release ({release_bytes / 1e9:.0f} GB, {release_params / 1e9:.1f} B parameters) at this "
          f"rate: {one:.1f} h on one host, {one / 16:.2f} h on 16")
  finally:
    shutil.rmtree(root, ignore_errors=True)

if __name__ == "__main__":
  main()
