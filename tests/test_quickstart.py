"""README.md's Quick start runs as printed: every command exits 0 and prints the sample lines shown under it.

The commands run as `python -m inspect_tool` with the same arguments from the repository root; the export's
and import's destinations (/tmp/ic-quickstart-*) are replaced by directories under pytest's tmp_path. The forward of the export
is also held to MaxText's own fp8_full run of the same checkpoint (tests/data/golden/c_fp8full_mtptrue.npz), and
every path the README and docs/ cite must exist.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
README = os.path.join(REPO, "README.md")
OUTPUTS = ("/tmp/ic-quickstart-fp8", "/tmp/ic-quickstart-import")  # replaced by directories under tmp_path


def quick_start_steps(text: str) -> list[tuple[list[str], list[str]]]:
  """(arguments after `inspect_checkpoint`, sample output lines) for each command of the Quick start section."""
  section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
  assert section, "README.md has no '## Quick start' section"
  blocks = re.findall(r"^```(\w+)\n(.*?)^```$", section.group(1), re.MULTILINE | re.DOTALL)
  steps = []
  for i, (lang, body) in enumerate(blocks):
    if lang != "bash":
      continue
    assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", f"no ```text sample output after: {body}"
    argv = shlex.split(body.replace("\\\n", " "), comments=True)
    assert argv and argv[0] == "inspect_checkpoint" and "inspect_checkpoint" not in argv[1:], body
    sample = [line.rstrip() for line in blocks[i + 1][1].splitlines() if line.strip() and line.strip() != "..."]
    steps.append((argv[1:], sample))
  return steps


STEPS = quick_start_steps(open(README, encoding="utf-8").read())


def test_quick_start_covers_every_flow():
  assert [args[0] for args, _ in STEPS] == ["maxtext", "orbax", "diff", "rules", "maxtext", "export", "forward",
                                            "import"]
  assert "--devices" in STEPS[4][0]
  assert all(sample for _, sample in STEPS)


def _run(args: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  return subprocess.run([sys.executable, "-m", "inspect_tool", *args], capture_output=True, text=True, cwd=REPO,
                        env=env, timeout=900, check=False)


def _local(text: str, tmp_path) -> str:
  for i, path in enumerate(OUTPUTS):
    text = text.replace(path, str(tmp_path / f"out{i}"))
  return text


def test_quick_start_commands_run_as_printed(tmp_path):
  outputs = []
  for args, sample in STEPS:
    args = [_local(a, tmp_path) for a in args]
    result = _run(args)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-2000:])
    lines = {line.rstrip() for line in (result.stdout + result.stderr).splitlines()}
    missing = [line for line in (_local(s, tmp_path) for s in sample) if line not in lines]
    assert not missing, (args[0], missing, result.stdout[-3000:])
    outputs.append(result.stdout)
  # The forward of the export against MaxText's own fp8_full forward of the same checkpoint and batch.
  golden = np.load(os.path.join(REPO, "tests", "data", "golden", "c_fp8full_mtptrue.npz"))
  main_loss = float(re.search(r"^main loss: (\S+)$", outputs[-2], re.MULTILINE).group(1))
  assert main_loss == pytest.approx(float(golden["main_xent_per_token"].mean()), abs=1e-6)
  mtp = re.search(r"^mtp depth 1: .* \(sum (\S+) over (\d+) tokens\)$", outputs[-2], re.MULTILINE)
  assert float(mtp.group(1)) == pytest.approx(float(golden["mtp_losses__mtp_block__losses"][0]), abs=1e-4)
  assert int(mtp.group(2)) == int(golden["mtp_losses__mtp_block__weights"][0])


def _cited_paths() -> list[tuple[str, str]]:
  """(document, path) for every repository path cited in backticks or as a relative link in README.md and docs/."""
  docs = [README] + sorted(os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                           if f.endswith(".md"))
  out = []
  for doc in docs:
    text = open(doc, encoding="utf-8").read()
    base = os.path.dirname(doc)
    for path in re.findall(r"`((?:inspect_tool|quant|tests|bench|constraints|scripts|docs)/[\w./*-]*)`", text):
      out.append((doc, os.path.join(REPO, path.split("::")[0])))
    for link in re.findall(r"\]\(([\w./-]+?)(?:#[\w-]*)?\)", text):
      if not link.startswith(("http", "#")):
        out.append((doc, os.path.normpath(os.path.join(base, link))))
  return out


def test_every_path_the_docs_cite_exists():
  cited = _cited_paths()
  assert len(cited) > 50
  missing = [(os.path.relpath(doc, REPO), os.path.relpath(path, REPO)) for doc, path in cited
             if not glob.glob(path.rstrip("/"))]
  assert not missing, missing
