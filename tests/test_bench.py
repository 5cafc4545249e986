"""Every bench/ script runs in its --tiny mode (smallest inputs, one round): exit 0 and its ratio line.

Figures are not asserted (speed is measured by the scripts themselves, not by tests); this keeps the scripts working.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# The bench scripts run where benchmarks are measured: once, on the primary stack (.ci/run).
pytestmark = pytest.mark.slow

from conftest import REPO
NUMBER = r"\d+(?:\.\d+)?"

# script -> lines its tiny run must print (regular expressions, one per line, multiline mode)
RATIO_LINES = {
    "bench_cli.py": [rf"^tiny unscanned / tiny scanned: {NUMBER}x wall, {NUMBER}x CPU$"],
    "bench_sharding.py": [rf"^tiny scanned\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+≤2\s+{NUMBER}$"],
    "bench_forward.py": [rf"^tiny L4 V1024\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$"],
    "bench_gmm.py": [rf"^tokens 256 wi: M 2048, K 224, N 64, 4 experts, forward$",
                     rf"^\s+ours bf16\s+{NUMBER} ms\s+{NUMBER} TFLOP/s\s+n/a$",
                     rf"^\s+ours fp8_full\s+{NUMBER} ms\s+{NUMBER} TFLOP/s\s+n/a$"],
    "bench_checkpoint.py": [rf"ratio restore/cat = {NUMBER}$", r"^\(a\) inspect_checkpoint orbax --path: median of 1"],
    "bench_import.py": [rf"^\[tiny\] import throughput: {NUMBER} MB/s of float16 source, {NUMBER} M parameters/s$",
                        rf"^import \(float32\)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$",
                        rf"^import --max-memory \d+MiB \(1\.5x floor\)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$",
                        rf"^bounded import: peak RSS {NUMBER} MB = {NUMBER} x its --max-memory; medians of 1$"],
    "bench_compile_cache.py": [rf"^forward\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s",
                               rf"^export\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s"],
    "bench_gcs.py": [rf"^local -> local\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+1\.00x$",
                     rf"^local -> gs\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                     rf"^local -> gs, replacing\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                     rf"^gs -> local\s+(?:{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x|n/a \(.*\))$",
                     rf"^gs -> gs\s+(?:{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x|n/a \(.*\))$",
                     rf"^orbax save -> gs\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                     rf"^orbax save -> local\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                     rf"^what gs:// adds: export -?{NUMBER} s \(local -> gs less local -> local\), Orbax -?{NUMBER} s "
                     rf"\(its save to gs less its save to local disk\): (?:-?{NUMBER}|inf)x$",
                     rf"^local -> gs by stage \(beside local -> local\): write {NUMBER} s \([+-]{NUMBER}\), merge "
                     rf"{NUMBER} s \([+-]{NUMBER}\), manifest {NUMBER} s \([+-]{NUMBER}\), publish {NUMBER} s "
                     rf"\([+-]{NUMBER}\)$",
                     rf"^local -> gs beside Orbax: time {NUMBER}x \(its save alone {NUMBER} s: {NUMBER}x\), peak RSS "
                     rf"{NUMBER}x \(goal <= 1\.2x\)$",
                     rf"^replacing that export \(--overwrite\): {NUMBER} s, {NUMBER}x Orbax's restore \+ save to gs, of "
                     rf"which publishing \(the copy of the staging prefix\) {NUMBER} s$",
                     rf"^orbax -> gs, our files\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                     rf"^rounds \(wall s, in run order\): local -> gs {NUMBER}; orbax save -> gs {NUMBER}; "
                     rf"orbax -> gs, our files {NUMBER}$",
                     rf"^local -> gs over orbax save -> gs, round by round: {NUMBER}; median {NUMBER}x; over its "
                     rf"median time {NUMBER}x$",
                     rf"^local -> gs over orbax -> gs, our files, round by round: {NUMBER}; median {NUMBER}x; over "
                     rf"its median time {NUMBER}x$"],
    "bench_xla_compile.py": [rf"^tiny v5p-8\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+(?:{NUMBER}|n/a)\s+{NUMBER}\s+"
                             rf"{NUMBER}x\s+(?:{NUMBER}x|n/a)\s+{NUMBER}x$",
                             rf"^second run \(compilation cache\): {NUMBER} s, {NUMBER} MB: {NUMBER}x"],
    "bench_header.py": [rf"^refused at tensor 0\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                        rf"^valid, read whole\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
                        rf"^refused at tensor 0 in {NUMBER} s wall \(goal: under 5 s\): (within|OVER)"],
    "bench_web.py": [rf"^hf --summary\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x\s+[\d,]+\s+{NUMBER}%$",
                     rf"^hf --keys\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x\s+[\d,]+\s+{NUMBER}%$",
                     r"^  of which safetensors headers: ([\d,]+) bytes \(the headers are \1\); \d+ requests$"],
    "bench_export.py": [
        rf"^\[tiny/{chunks}\] {case}\s+{NUMBER} s .* {NUMBER} x Orbax's time" for chunks in ("single", "256KiB")
        for case in (r"orbax restore\+save", "export", r"export --max-memory \d+MiB \(1\.5x floor\)",
                     "decode-only read of the source", "encode-only write of the output")] + [
        rf"^\[tiny/single\] smallest --max-memory the tool accepts: export {NUMBER} MiB",
        rf"^\[tiny/256KiB\] floor of the work \(decode-only read \+ encode-only write\): {NUMBER} s; Orbax {NUMBER} x, "
        rf"export {NUMBER} x, export --max-memory \d+MiB \(1\.5x floor\) {NUMBER} x it$",
        rf"^\[tiny/256KiB\] decode amplification \(bytes decoded / bytes stored\): export (n/a|{NUMBER})",
        rf"^\[tiny/single\] export --max-memory \d+MiB \(1\.5x floor\): peak RSS {NUMBER} MB = {NUMBER} x its "
        r"--max-memory$",
        r"^\[tiny/single\] bounded export equals the unbounded one byte for byte: True$",
        r"^\[tiny/256KiB\] export equals the export of the first source byte for byte: True$",
        rf"^tiny/single\s+{NUMBER}\s+{NUMBER} \({NUMBER}\)\s+{NUMBER} \({NUMBER}\)\s+-\s+-\s+{NUMBER}\s+"
        rf"(n/a|{NUMBER})$"],
}


def test_every_bench_script_has_a_tiny_case():  # `_name.py`: a module the scripts share, not a script
  scripts = [f for f in os.listdir(os.path.join(REPO, "bench")) if f.endswith(".py") and not f.startswith("_")]
  assert sorted(scripts) == sorted(RATIO_LINES)


def test_bench_export_runs_beside_a_baseline_tree():
  """`bench_export.py --baseline TREE` (here this tree itself) runs that tree's export in the same rounds and prints
  ours over it."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  out = subprocess.run([sys.executable, os.path.join("bench", "bench_export.py"), "--tiny", "--baseline", REPO],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  for chunks in ("single", "256KiB"):
    for case in ("export", r"export --max-memory \d+MiB \(1\.5x floor\)"):
      assert re.search(rf"^\[tiny/{chunks}\] {case} / export at \S+( --max-memory \d+MiB)?: {NUMBER} x \(medians; "
                       rf"rounds {NUMBER}; CPU {NUMBER} x\)$", out.stdout, re.MULTILINE), (case, out.stdout[-3000:])


@pytest.mark.parametrize("script", sorted(RATIO_LINES))
def test_bench_script_runs_in_tiny_mode(script):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  out = subprocess.run([sys.executable, os.path.join("bench", script), "--tiny"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=600, check=False)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  for pattern in RATIO_LINES[script]:
    assert re.search(pattern, out.stdout, re.MULTILINE), (pattern, out.stdout[-3000:])
