"""Benchmark: whole-process wall time and peak RSS of CLI commands (median of N runs).

Run: .venv-py3.12/bin/python bench/bench_cli.py [--runs 5] [--only CASE ...] [--peer MAXTEXT_PYTHON]
Targets: 671B and Kimi K2 1T scanned listings ≤ 1.5 s and ≤ 250 MB; unscanned (671B, DeepSeek-V4 284B: 1,887
weights) ≤ 2.5 s, the V4 figure printed beside the 671B one as a ratio; --help ≤ 0.3 s;
rules report for 671B fp8_full with quantize_mtp ≤ 3 s and ≤ 400 MB.
The load average (`os.getloadavg`) is printed before and after: on a shared machine wall time follows it.
`--peer` names the Python of a MaxText 0.2.5 venv: the listing cases then also run MaxText's own
`inspect_checkpoint` (JAX_PLATFORMS=cpu) and print its figures and ours as ratios.
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
    "deepseek4-284b unscanned": [BIN, "maxtext", "model_name=deepseek4-284b", "scan_layers=false"],
    "671b unscanned --html": [BIN, "maxtext", "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1",
                              "--html", os.path.join(tempfile.gettempdir(), "bench_cli_671b_unscanned.html")],
    "kimi-k2-1t scanned + MTP": [BIN, "maxtext", "model_name=kimi-k2-1t", "mtp_num_layers=1"],
    "671b rules fp8_full MTP": [BIN, "rules", "model_name=deepseek3-671b", "mtp_num_layers=1", "quantization=fp8_full",
                                "quantize_mtp=true"],
}


def peer_command(python: str, cmd: list[str]) -> list[str] | None:
  """MaxText's own command for a `maxtext` listing case (same keys), or None."""
  if len(cmd) < 2 or cmd[1] != "maxtext" or "--html" in cmd:
    return None
  return [python, "-m", "maxtext.checkpoint_conversion.inspect_checkpoint", *cmd[1:]]


def measure(cmd: list[str]) -> tuple[float, float]:
  """Wall seconds and peak RSS (MB) of one child process (its CPU seconds go to CPU_SECONDS)."""
  start = time.perf_counter()
  pid = os.fork()
  if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.execve(cmd[0], cmd, {**os.environ, "JAX_PLATFORMS": "cpu"})
  _, status, usage = os.wait4(pid, 0)
  wall = time.perf_counter() - start
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"{' '.join(cmd)} failed")
  CPU_SECONDS.append(usage.ru_utime + usage.ru_stime)
  return wall, usage.ru_maxrss / 1024


CPU_SECONDS: list[float] = []  # user + system time of each child: a figure that a busy machine disturbs less


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--only", choices=list(CASES), action="append", help="a case to run (repeatable)")
  parser.add_argument("--peer", help="Python of a MaxText 0.2.5 venv, to compare the listing cases with")
  args = parser.parse_args()
  print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
  print(f"{'case':26s} {'median s':>9s} {'min s':>7s} {'CPU s':>7s} {'peak RSS MB':>12s}"
        + (f" {'MaxText s':>10s} {'MaxText MB':>11s} {'time ratio':>10s} {'RSS ratio':>10s}" if args.peer else ""))
  results = {}
  for name, cmd in CASES.items():
    if args.only and name not in args.only:
      continue
    del CPU_SECONDS[:]
    wall, fastest, rss = _median(cmd, args.runs)
    results[name] = (wall, statistics.median(CPU_SECONDS))
    line = f"{name:26s} {wall:9.3f} {fastest:7.3f} {results[name][1]:7.3f} {rss:12.1f}"
    peer = peer_command(args.peer, cmd) if args.peer else None
    if peer:
      peer_wall, _, peer_rss = _median(peer, max(1, args.runs // 2))
      line += f" {peer_wall:10.3f} {peer_rss:11.1f} {wall / peer_wall:10.3f} {rss / peer_rss:10.3f}"
    print(line)
  v4, v3 = results.get("deepseek4-284b unscanned"), results.get("671b unscanned + MTP")
  if v4 and v3:
    print(f"deepseek4-284b unscanned / 671b unscanned + MTP: {v4[0] / v3[0]:.3f}x wall, {v4[1] / v3[1]:.3f}x CPU "
          f"(target: both <= 2.5 s wall; V4 {'within' if v4[0] <= 2.5 else 'OVER'})")
  print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def _median(cmd: list[str], runs: int) -> tuple[float, float, float]:
  """Median and fastest wall seconds, and peak RSS MB, over `runs` runs after one that warms the page cache."""
  measure(cmd)
  results = [measure(cmd) for _ in range(runs)]
  walls = [w for w, _ in results]
  return statistics.median(walls), min(walls), max(r for _, r in results)


if __name__ == "__main__":
  main()
