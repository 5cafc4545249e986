"""Benchmark: `maxtext --compile --train adamw` (our training step compiled for a TPU topology on this CPU host) vs
MaxText 0.2.5's own `train_compile` of the same keys: wall time and peak RSS side by side, as ratios; then our second
run of the same command, served from JAX's persistent compilation cache.

Run: .venv-py3.12/bin/python bench/bench_xla_compile.py [--maxtext /work/venvs/maxtext/bin/python] [--tiny]
Default case: deepseek3-671b with MTP on v5p-512 (fsdp 32 x expert 8, per_device_batch_size=1, max_target_length=2048);
`--tiny`: deepseek3-tiny with MTP on v5p-8 (batch 1 x 256). With `--maxtext PYTHON` (MaxText 0.2.5's venv with libtpu)
MaxText is run here, one compile after the other; without it MaxText's figures are the ones recorded on this host
(tests/data/xla_ref/*.json: `wall_s`, `peak_rss_mb`, and `cpu_s` where recorded), labelled so. Wall time on a shared
host follows its load: the CPU time (user + system) is the fairer comparison. Run nothing else heavy meanwhile: both sides
compile on every core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402  pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "671b v5p-512": ("v5p-512", ["model_name=deepseek3-671b", "mtp_num_layers=1", "ici_fsdp_parallelism=32",
                                 "ici_expert_parallelism=8", "per_device_batch_size=1", "max_target_length=2048"],
                     "671b_v5p-512_b1_s2048_mtp1_fsdp32_ep8.json"),
    "tiny v5p-8": ("v5p-8", ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1",
                             "max_target_length=256"], "tiny_v5p-8_b1_s256_mtp1.json"),
}


def _ours(topology, keys, cache_dir):
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, INSPECT_CHECKPOINT_COMPILE_CACHE="1")
  cmd = [sys.executable, "-m", "inspect_tool", "maxtext", *keys, "--topology", topology, "--compile", "--train",
         "adamw", "--format", "json"]
  run = _measure.timed(cmd, env, cwd=REPO, ok=(0, 1))
  return run, json.loads(run.stdout)["xla"]["train"]


def _maxtext(python, topology, keys):
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  cmd = [python, "-m", "maxtext.trainers.pre_train.train_compile", f"compile_topology={topology}",
         "compile_topology_num_slices=1", *keys]
  with tempfile.TemporaryDirectory() as work:
    run = _measure.timed(cmd, env, cwd=work)
  return run.wall, run.cpu, run.rss / 2**20, "measured now"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--maxtext", help="MaxText 0.2.5's python (with libtpu) to run its train_compile here")
  parser.add_argument("--tiny", action="store_true", help="deepseek3-tiny on v5p-8 instead of the 671B on v5p-512")
  args = parser.parse_args()
  name = "tiny v5p-8" if args.tiny else "671b v5p-512"
  topology, keys, recorded = CASES[name]
  with open(os.path.join(REPO, "tests", "data", "xla_ref", recorded), encoding="utf-8") as f:
    reference = json.load(f)
  if args.maxtext:
    their_wall, their_cpu, their_rss, how = _maxtext(args.maxtext, topology, keys)
  else:
    their_wall, their_cpu, their_rss = reference["wall_s"], reference.get("cpu_s"), reference["peak_rss_mb"]
    how = "recorded (tests/data/xla_ref; its CPU time when recorded)"
  with tempfile.TemporaryDirectory() as cache:
    cold, stats = _ours(topology, keys, cache)
    warm, _ = _ours(topology, keys, cache)
  ours_rss = cold.rss / 2**20
  print(f"case: {name} (keys: {' '.join(keys)}); MaxText: {how}")
  cpu = f"{their_cpu:10.1f}" if their_cpu else f"{'n/a':>10s}"
  cpu_ratio = f"{cold.cpu / their_cpu:9.2f}x" if their_cpu else f"{'n/a':>10s}"
  print(f"{'':16s} {'ours wall s':>11s} {'CPU s':>7s} {'MB':>6s} {'MaxText wall s':>14s} {'CPU s':>10s} {'MB':>6s} "
        f"{'wall ratio':>10s} {'CPU ratio':>10s} {'RSS ratio':>10s}")
  print(f"{name:16s} {cold.wall:11.1f} {cold.cpu:7.1f} {ours_rss:6.0f} {their_wall:14.1f} {cpu} {their_rss:6.0f} "
        f"{cold.wall / their_wall:9.2f}x {cpu_ratio} {ours_rss / their_rss:9.2f}x")
  print(f"load average now: {os.getloadavg()[0]:.1f} (wall times on a shared host follow the load; CPU times less so)")
  print(f"second run (compilation cache): {warm.wall:.1f} s, {warm.rss / 2**20:.0f} MB: {warm.wall / cold.wall:.2f}x "
        "the first run's time")
  theirs = reference["memory_analysis"]
  print(f"XLA peak per device: ours {stats['peak_bytes'] / 2**30:.2f} GiB, MaxText {reference['peak_bytes'] / 2**30:.2f} "
        f"GiB ({stats['peak_bytes'] / reference['peak_bytes']:.3f}x); arguments "
        f"{stats['argument_size_in_bytes'] / theirs['argument_size_in_bytes']:.4f}x")


if __name__ == "__main__":
  main()
