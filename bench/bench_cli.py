"""Benchmark: whole-process wall time and peak RSS of CLI commands (median of N runs).

Run: .venv/bin/python bench/bench_cli.py [--runs 5] [--only CASE]
Targets: 671B scanned listing ≤ 1.5 s and ≤ 250 MB; unscanned ≤ 2.5 s; --help ≤ 0.3 s;
rules report for 671B fp8_full with quantize_mtp ≤ 3 s and ≤ 400 MB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(sys.executable), "inspect_checkpoint")

CASES = {
    "help": [BIN, "--help"],
    "671b scanned + MTP": [BIN, "maxtext", "model_name=deepseek3-671b", "scan_layers=true", "mtp_num_layers=1"],
    "671b unscanned + MTP": [BIN, "maxtext", "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1"],
    "671b unscanned --html": [BIN, "maxtext", "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1",
                              "--html", os.path.join(tempfile.gettempdir(), "bench_cli_671b_unscanned.html")],
    "671b rules fp8_full MTP": [BIN, "rules", "model_name=deepseek3-671b", "mtp_num_layers=1", "quantization=fp8_full",
                                "quantize_mtp=true"],
}


def measure(cmd: list[str]) -> tuple[float, float]:
  """Wall seconds and peak RSS (MB) of one child process."""
  start = time.perf_counter()
  pid = os.fork()
  if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.execv(cmd[0], cmd)
  _, status, usage = os.wait4(pid, 0)
  wall = time.perf_counter() - start
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"{' '.join(cmd)} failed")
  return wall, usage.ru_maxrss / 1024


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--only", choices=list(CASES))
  args = parser.parse_args()
  print(f"{'case':26s} {'median s':>9s} {'min s':>7s} {'peak RSS MB':>12s}")
  for name, cmd in CASES.items():
    if args.only and name != args.only:
      continue
    measure(cmd)  # warm the page cache
    runs = [measure(cmd) for _ in range(args.runs)]
    walls = [w for w, _ in runs]
    print(f"{name:26s} {statistics.median(walls):9.3f} {min(walls):7.3f} {max(r for _, r in runs):12.1f}")


if __name__ == "__main__":
  main()
