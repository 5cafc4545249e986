"""Benchmark: whole-process wall time and peak RSS of CLI commands (median of N runs).

Run: .venv-py3.12/bin/python bench/bench_cli.py [--runs 5] [--only CASE ...] [--peer MAXTEXT_PYTHON] [--tiny]
Targets: 671B and Kimi K2 1T scanned listings ≤ 1.5 s and ≤ 250 MB; unscanned (671B, DeepSeek-V4 284B: 1,887
weights) ≤ 2.5 s, the V4 figure printed beside the 671B one as a ratio; --help ≤ 0.3 s;
rules report for 671B fp8_full with quantize_mtp ≤ 3 s and ≤ 400 MB.
The load average (`os.getloadavg`) is printed before and after: on a shared machine wall time follows it.
`--peer` names the Python of a MaxText 0.2.5 venv: the listing cases then also run MaxText's own
`inspect_checkpoint` (JAX_PLATFORMS=cpu) and print its figures and ours as ratios.
`--tiny` (a smoke run, seconds): one run of --help and the deepseek3-tiny listings, scanned and unscanned, and the
ratio line between them.
The CLI runs as `python -m inspect_tool` with this checkout first on PYTHONPATH (the code of this checkout).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "inspect_tool"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get(
    "PYTHONPATH")]))}
# Every --html run writes over the last one's page (without --overwrite the second run would be refused).
HTML = os.path.join(tempfile.gettempdir(), f"bench_cli_{os.getpid()}_671b_unscanned.html")

CASES = {
    "help": [*CLI, "--help"],
    "671b scanned + MTP": [*CLI, "maxtext", "model_name=deepseek3-671b", "scan_layers=true", "mtp_num_layers=1"],
    "671b unscanned + MTP": [*CLI, "maxtext", "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1"],
    "deepseek4-284b unscanned": [*CLI, "maxtext", "model_name=deepseek4-284b", "scan_layers=false"],
    "671b unscanned --html": [*CLI, "maxtext", "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1",
                              "--html", HTML, "--overwrite"],
    "kimi-k2-1t scanned + MTP": [*CLI, "maxtext", "model_name=kimi-k2-1t", "mtp_num_layers=1"],
    "671b rules fp8_full MTP": [*CLI, "rules", "model_name=deepseek3-671b", "mtp_num_layers=1", "quantization=fp8_full",
                                "quantize_mtp=true"],
}
TINY_KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1"]
TINY_CASES = {
    "help": CASES["help"],
    "tiny scanned + MTP": [*CLI, "maxtext", *TINY_KEYS],
    "tiny unscanned + MTP": [*CLI, "maxtext", *TINY_KEYS, "scan_layers=false"],
}


def peer_command(python: str, cmd: list[str]) -> list[str] | None:
  """MaxText's own command for a `maxtext` listing case (same keys), or None."""
  args = cmd[len(CLI):]
  if not args or args[0] != "maxtext" or "--html" in args:
    return None
  return [python, "-m", "maxtext.checkpoint_conversion.inspect_checkpoint", *args]


def measure(cmd: list[str]) -> tuple[float, float]:
  """Wall seconds and peak RSS (MB) of one child process (its CPU seconds go to CPU_SECONDS)."""
  start = time.perf_counter()
  pid = os.fork()
  if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.chdir(REPO)
    os.execve(cmd[0], cmd, ENV)
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
  parser.add_argument("--only", choices=list(CASES) + list(TINY_CASES), action="append",
                      help="a case to run (repeatable)")
  parser.add_argument("--peer", help="Python of a MaxText 0.2.5 venv, to compare the listing cases with")
  parser.add_argument("--tiny", action="store_true", help="smoke run: one run of the deepseek3-tiny listings")
  args = parser.parse_args()
  cases = TINY_CASES if args.tiny else CASES
  if args.tiny:
    args.runs = 1
  print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
  print(f"{'case':26s} {'median s':>9s} {'min s':>7s} {'CPU s':>7s} {'peak RSS MB':>12s}"
        + (f" {'MaxText s':>10s} {'MaxText MB':>11s} {'time ratio':>10s} {'RSS ratio':>10s}" if args.peer else ""))
  results = {}
  for name, cmd in cases.items():
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
  scanned, unscanned = results.get("tiny scanned + MTP"), results.get("tiny unscanned + MTP")
  if scanned and unscanned:
    print(f"tiny unscanned / tiny scanned: {unscanned[0] / scanned[0]:.3f}x wall, {unscanned[1] / scanned[1]:.3f}x CPU")
  print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
  if os.path.exists(HTML):
    os.remove(HTML)


def _median(cmd: list[str], runs: int) -> tuple[float, float, float]:
  """Median and fastest wall seconds, and peak RSS MB, over `runs` runs after one that warms the page cache."""
  measure(cmd)
  results = [measure(cmd) for _ in range(runs)]
  walls = [w for w, _ in results]
  return statistics.median(walls), min(walls), max(r for _, r in results)


if __name__ == "__main__":
  main()
