"""Benchmark: the sharding listing (`--devices`) against the plain listing, whole process, median of N runs.

Run: .venv-py3.12/bin/python bench/bench_sharding.py [--runs 5] [--peer MAXTEXT_PYTHON --peer-path PYTHONPATH] [--tiny]
Target: 671B on 256 devices (fsdp 32 × expert 8, with --summary --train adamw) within 2× the plain 671B
listing's time (scanned and unscanned). `--peer` also times MaxText 0.2.5 printing the same sharding on 256 fake
CPU devices (`tests/data/sharding/generate.py`) and prints our time as a ratio of it.
`--tiny` (a smoke run, seconds): one run of each, deepseek3-tiny on 8 devices (fsdp 2 x expert 4), scanned only.
"""

from __future__ import annotations

import argparse
import os
import sys

import bench_cli  # the whole-process timer shared with the CLI benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ["model_name=deepseek3-671b", "mtp_num_layers=1", "ici_fsdp_parallelism=32", "ici_expert_parallelism=8"]
SHARDED = ["--devices", "256", "--summary", "--train", "adamw", "--device-memory", "95GiB"]
CLI = bench_cli.CLI
PAIRS = {
    "671b scanned": ([*CLI, "maxtext", *KEYS], [*CLI, "maxtext", *KEYS, *SHARDED]),
    "671b unscanned": ([*CLI, "maxtext", *KEYS, "scan_layers=false"],
                       [*CLI, "maxtext", *KEYS, "scan_layers=false", *SHARDED]),
}
TINY_KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "ici_fsdp_parallelism=2", "ici_expert_parallelism=4"]
TINY_PAIRS = {
    "tiny scanned": ([*CLI, "maxtext", *TINY_KEYS],
                     [*CLI, "maxtext", *TINY_KEYS, "--devices", "8", "--summary", "--train", "adamw"]),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--peer", help="Python of a MaxText 0.2.5 environment")
  parser.add_argument("--peer-path", default="", help="PYTHONPATH for --peer (MaxText and its dependencies)")
  parser.add_argument("--tiny", action="store_true", help="smoke run: one run, deepseek3-tiny on 8 devices")
  args = parser.parse_args()
  if args.tiny:
    args.runs = 1
  print(f"{'case':16s} {'plain s':>8s} {'sharded s':>10s} {'ratio':>6s} {'target':>6s} {'sharded MB':>11s}"
        + (f" {'MaxText s':>10s} {'ours/MaxText':>13s}" if args.peer else ""))
  for name, (plain, sharded) in (TINY_PAIRS if args.tiny else PAIRS).items():
    plain_s, _, _ = bench_cli._median(plain, args.runs)  # pylint: disable=protected-access
    sharded_s, _, rss = bench_cli._median(sharded, args.runs)  # pylint: disable=protected-access
    line = f"{name:16s} {plain_s:8.3f} {sharded_s:10.3f} {sharded_s / plain_s:6.2f} {'≤2':>6s} {rss:11.1f}"
    if args.peer:
      os.environ["PYTHONPATH"] = args.peer_path
      generator = os.path.join(REPO, "tests", "data", "sharding", "generate.py")
      extra = ["scan_layers=false"] if "unscanned" in name else []
      peer_s, _, _ = bench_cli._median([args.peer, generator, "256", *KEYS, *extra],  # pylint: disable=protected-access
                                       max(1, args.runs // 2))
      line += f" {peer_s:10.3f} {sharded_s / peer_s:13.3f}"
    print(line)


if __name__ == "__main__":
  sys.exit(main())
