"""One job runner owns the write sequence of `export` (both layouts) and `import` (`streaming.job_runner`): the
order of its steps on one process, a stop before the commit, and no pipeline with a barrier of its own."""

from __future__ import annotations

import ast
import dataclasses
import json
import os

import pytest

from inspect_tool import errors
from inspect_tool.output import atomic
from inspect_tool.output import stop
from inspect_tool.streaming import job_runner

from conftest import REPO


@dataclasses.dataclass
class _Report:
  """A run's report, as the pipelines' typed records give it (`job_runner.Report`)."""

  doc: dict

  def to_dict(self) -> dict:
    return self.doc


def _recorded(monkeypatch) -> list[str]:
  steps = []
  monkeypatch.setattr(atomic, "test_point", lambda name, before=None: steps.append(f"point {name}"))
  return steps


def test_the_steps_run_in_order_and_the_report_is_committed_with_the_writes(tmp_path, monkeypatch):
  steps = _recorded(monkeypatch)

  def write(tmp):
    steps.append("write")
    atomic.write_inside(tmp, "data.bin", "x")
    return "written"

  def merged(tmp, written):
    steps.append(f"merged {written}")
    return "manifest"

  def report(tmp, written, after):
    steps.append(f"report {written} {after}")
    return _Report({"ok": True})

  dst = tmp_path / "dst"
  document = job_runner.run(str(dst), False, "report.json", write, report, merged=merged)
  assert document.to_dict() == {"ok": True}
  assert steps == ["point start", "write", "merged written", "point written", "report written manifest",
                   "point report", "point swap"]  # swap: the commit
  assert sorted(os.listdir(dst)) == ["data.bin", "report.json"]
  assert json.loads((dst / "report.json").read_text()) == {"ok": True}


def test_a_stop_while_the_report_is_made_commits_nothing(tmp_path, monkeypatch):
  _recorded(monkeypatch)
  stop.clear()

  def report(tmp, written, after):  # pylint: disable=unused-argument
    stop._received.append(15)  # pylint: disable=protected-access  # as the handler records a SIGTERM
    return _Report({})

  try:
    with pytest.raises(errors.Interrupted):
      job_runner.run(str(tmp_path / "dst"), False, "report.json", lambda tmp: None, report)
  finally:
    stop.clear()
  assert [n for n in os.listdir(tmp_path) if not n.startswith(".dst.lock")] == []


def _calls(path: str, name: str) -> list[int]:
  tree = ast.parse(open(path, encoding="utf-8").read())
  return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
          and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)]


@pytest.mark.parametrize("pipeline, runs", [("inspect_tool/fp8_export/pipeline.py", 2),  # Orbax, HF layouts
                                             ("inspect_tool/hf_import/pipeline.py", 1)])
def test_the_pipelines_call_the_runner_and_no_barrier_of_their_own(pipeline, runs):
  """Once `_export` and `_import` typed the same fifteen steps, barriers and test points included."""
  path = os.path.join(REPO, pipeline)
  assert (_calls(path, "barrier"), _calls(path, "temporary_directory"), _calls(path, "plan_jobs")) == ([], [], [])
  text = open(path, encoding="utf-8").read()
  assert [n for n in ("start", "written", "report") if f'test_point("{n}")' in text] == []
  assert text.count("job_runner.run(") == runs and text.count("job_runner.plan(") == 1
