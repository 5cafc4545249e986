"""Benchmarks second runs: `forward` and `export` of MaxText's tiny checkpoint, first and second run in fresh processes
sharing a fresh JAX persistent compilation cache (the default since issue 24), and the ratio second / first.

Cases (tests/data/ckpt_deepseek3-tiny-L4-V1024, 1.4 M parameters, `quantization=fp8_full quantize_mtp=true`):
  * forward: `inspect_checkpoint forward ... --checkpoint CKPT` (one forward pass under Qwix QT);
  * export: `inspect_checkpoint export ... --checkpoint CKPT --output DST` (quantize, write, validate: three
    forward passes).
Each round gives every case a new cache directory (JAX_COMPILATION_CACHE_DIR) and runs it twice, each run a new
process (so the second run has only the disk cache, as a user's next command does); wall times include Python and
JAX start-up. Medians over the rounds; the target is second / first <= 0.6. The two runs' stdout must agree (the
export's first line names its own output directory and is left out).

  .venv-py3.12/bin/python bench/bench_compile_cache.py [--rounds 3] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
MODEL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
         "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full", "quantize_mtp=true"]
CASES = {
    "forward": lambda work, tiny: ["forward", *MODEL, "--checkpoint", CKPT],
    # --tiny leaves out the export's validation (its three forwards are most of this bench's time, and
    # tests/test_compile_cache.py checks the cache's hits): the run checks the script, its figures mean nothing.
    "export": lambda work, tiny: ["export", *MODEL, "--checkpoint", CKPT, "--output", os.path.join(work, "out"),
                                  *(["--no-validate"] if tiny else [])],
}
TARGET = 0.6


def _run(argv: list[str], cache: str) -> tuple[float, str]:
  env = {k: v for k, v in os.environ.items() if k != "INSPECT_CHECKPOINT_COMPILE_CACHE"}
  env["JAX_COMPILATION_CACHE_DIR"] = cache
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
  start = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "inspect_tool", *argv, "--quiet"], capture_output=True, text=True,
                       env=env, cwd=REPO, check=False)
  seconds = time.perf_counter() - start
  if out.returncode != 0:
    raise SystemExit(f"{' '.join(argv[:1])} failed ({out.returncode}): {out.stderr[-2000:]}")
  return seconds, out.stdout


def _round(name: str, tiny: bool) -> tuple[float, float, int]:
  """First and second wall time of one case with a new cache, and the cache's size in bytes after them."""
  work = tempfile.mkdtemp(prefix=f"bench_compile_cache_{name}_")
  try:
    cache = os.path.join(work, "cache")
    times, outputs = [], []
    for _ in range(2):
      seconds, stdout = _run(CASES[name](work, tiny), cache)
      times.append(seconds)
      outputs.append(stdout.split("\n", 1)[1] if name == "export" else stdout)
      shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
    if outputs[0] != outputs[1]:
      raise SystemExit(f"{name}: the second run printed something else than the first")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(cache) for f in files)
    return times[0], times[1], size
  finally:
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rounds", type=int, default=3, help="rounds (median reported)")
  parser.add_argument("--tiny", action="store_true", help="one round, the export without validation (a quick check)")
  args = parser.parse_args()
  rounds = 1 if args.tiny else max(1, args.rounds)
  print(f"{rounds} round(s); each: a new cache, then two runs in new processes")
  print(f"{'case':8s} {'first s':>8s} {'second s':>9s} {'second/first':>13s} {'cache':>9s}  range (first; second)")
  worst = 0.0
  for name in CASES:
    results = [_round(name, args.tiny) for _ in range(rounds)]
    first = statistics.median(r[0] for r in results)
    second = statistics.median(r[1] for r in results)
    ratio = second / first
    worst = max(worst, ratio)
    spread = (f"{min(r[0] for r in results):.1f}-{max(r[0] for r in results):.1f}; "
              f"{min(r[1] for r in results):.1f}-{max(r[1] for r in results):.1f}")
    print(f"{name:8s} {first:8.1f} {second:9.1f} {ratio:13.2f} {results[-1][2] / 2**20:7.1f}MB  {spread}")
  verdict = "not judged in a --tiny run" if args.tiny else "met" if worst <= TARGET else "NOT met"
  print(f"target second/first <= {TARGET}: {verdict} (worst {worst:.2f})")


if __name__ == "__main__":
  main()
