"""Benchmark: a safetensors header of up to 100 MB refused at its first bad tensor, and read whole when valid.

Run: .venv-py3.12/bin/python bench/bench_header.py [--runs 3] [--tensors 1580000] [--tiny]
The file: one header of `--tensors` entries (1.58 million fill 100 MB: the safetensors library's own limit is
100,000,000 bytes, ours 100 MiB), written once into a temporary directory. Cases, alternated run by run (A B A B ...):
- `hf --path` of the file whose tensor 0 holds 8 bytes for 4 (`holds 8 bytes; F32 [1] needs 4`): goal under 5 s
  (issue 51); the peer is the safetensors library's `safe_open` (Rust), which refuses the same file after parsing
  the whole header;
- `hf --path` of the same header with every tensor valid, beside `safe_open` and its `keys()`.
Figures are whole processes (Python's start-up and imports included) under /usr/bin/time: median wall and CPU
seconds, ours / the peer's as ratios. The load average is printed before and after: on a shared machine wall time
follows it. `--tiny` (a smoke run): 10,000 tensors, one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402  pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get(
    "PYTHONPATH")]))}
OURS = [sys.executable, "-m", "inspect_tool", "hf", "--path"]
PEER = [sys.executable, "-c", "import sys\nfrom safetensors import safe_open\ntry:\n  with safe_open(sys.argv[1], "
        "'numpy') as f:\n    print(len(list(f.keys())))\nexcept Exception as e:\n  print(e, file=sys.stderr)\n  "
        "sys.exit(2)\n"]


def write(path: str, tensors: int, bad_first: bool) -> int:
  """A safetensors file of `tensors` entries (compact JSON, as the library writes it): tensor 0 F32 [1], the others
  F32 [0] (so that 1.58 million fill 100 MB, as in issue 51); returns the header bytes. With `bad_first`, tensor 0's
  offsets span 8 bytes."""
  end = 8 if bad_first else 4
  entries = [f'"w0":{{"dtype":"F32","shape":[1],"data_offsets":[0,{end}]}}']
  entries += [f'"w{i}":{{"dtype":"F32","shape":[0],"data_offsets":[{end},{end}]}}' for i in range(1, tensors)]
  header = ("{" + ",".join(entries) + "}").encode()
  header += b" " * (-len(header) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + bytes(end))
  return len(header)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--tensors", type=int, default=1_580_000)
  parser.add_argument("--tiny", action="store_true", help="smoke run: 10,000 tensors, one run")
  args = parser.parse_args()
  if args.tiny:
    args.runs, args.tensors = 1, 10_000
  print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
  with tempfile.TemporaryDirectory(prefix="bench_header_") as tmp:
    bad, good = os.path.join(tmp, "bad.safetensors"), os.path.join(tmp, "good.safetensors")
    size = write(bad, args.tensors, True)
    write(good, args.tensors, False)
    print(f"header: {size:,} bytes, {args.tensors:,} tensors; median of {args.runs} run(s), alternated with the peer")
    print(f"{'case':30s} {'ours s':>8s} {'CPU s':>7s} {'peer s':>8s} {'CPU s':>7s} {'ratio':>7s}")
    for case, path, ok, says in (("refused at tensor 0", bad, (2,), "'w0' holds 8 bytes"),
                                 ("valid, read whole", good, (0,), None)):
      ours, peer = [], []
      for _ in range(args.runs):
        ours.append(_measure.timed([*OURS, path], ENV, cwd=REPO, ok=ok))
        peer.append(_measure.timed([*PEER, path], ENV, cwd=REPO, ok=ok))
      if says is not None and says not in ours[-1].stderr:
        raise SystemExit(f"unexpected refusal: {ours[-1].stderr[-500:]}")
      wall, cpu = statistics.median(r.wall for r in ours), statistics.median(r.cpu for r in ours)
      peer_wall, peer_cpu = statistics.median(r.wall for r in peer), statistics.median(r.cpu for r in peer)
      print(f"{case:30s} {wall:8.2f} {cpu:7.2f} {peer_wall:8.2f} {peer_cpu:7.2f} {wall / peer_wall:6.2f}x")
      if says is not None:
        print(f"refused at tensor 0 in {wall:.2f} s wall (goal: under 5 s): {'within' if wall < 5 else 'OVER'}; "
              f"rounds {json.dumps([round(r.wall, 2) for r in ours])}")
  print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
  main()
