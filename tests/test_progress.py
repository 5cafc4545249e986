"""`progress.ByteProgress`: a tqdm bar on a terminal, a few plain lines in pipes (after a while), none with --quiet;
`progress.step`: a line on a terminal, in pipes only for `plain` steps (the named forward passes) that succeed."""

from __future__ import annotations

import io
import re

import pytest

from inspect_tool import progress


class _Terminal(io.StringIO):
  def isatty(self):
    return True


@pytest.fixture(autouse=True)
def _loud():
  progress.set_quiet(False)
  yield
  progress.set_quiet(False)


def _work(total=4 << 20):
  with progress.ByteProgress("exporting 4 arrays", total, 4) as bar:
    for _ in range(4):
      bar.update(total // 4, 1)


def test_terminal_gets_a_tqdm_bar_with_bytes_arrays_rate_and_eta(monkeypatch):
  err = _Terminal()
  monkeypatch.setattr("sys.stderr", err)
  _work()
  text = err.getvalue()
  assert "exporting 4 arrays" in text and "100%" in text and "4.00M/4.00M" in text and "arrays 4/4" in text
  assert "B/s" in text and "<" in text  # rate and the elapsed<remaining (ETA) field


def test_pipe_gets_a_few_plain_lines_only_for_long_work(monkeypatch):
  err = io.StringIO()
  monkeypatch.setattr("sys.stderr", err)
  _work()
  assert err.getvalue() == ""  # short work: silent
  monkeypatch.setattr(progress, "PLAIN_AFTER_SECONDS", 0.0)
  _work()
  lines = err.getvalue().splitlines()
  assert [l.split(": ")[1].split(" ")[0] for l in lines] == ["25%", "50%", "75%", "done,"]
  assert "(1/4 arrays, 1.0 MiB, " in lines[0] and "/s, ETA " in lines[0]


def test_quiet_silences_bars_lines_and_steps(monkeypatch):
  err = _Terminal()
  monkeypatch.setattr("sys.stderr", err)
  monkeypatch.setattr(progress, "PLAIN_AFTER_SECONDS", 0.0)
  progress.set_quiet(True)
  _work()
  with progress.step("tracing"):
    pass
  with progress.step("validation 1/3: source under the export's numerics", plain=True):
    pass
  progress.note("validation skipped")
  assert err.getvalue() == ""


def test_quick_plain_steps_stay_silent_off_a_terminal(monkeypatch):
  err = io.StringIO()
  monkeypatch.setattr("sys.stderr", err)
  with progress.step("validation 2/3: source unquantized", plain=True):
    pass
  assert err.getvalue() == ""


def test_long_plain_steps_print_a_line_when_done_off_a_terminal_and_others_stay_silent(monkeypatch):
  err = io.StringIO()
  monkeypatch.setattr("sys.stderr", err)
  monkeypatch.setattr(progress, "PLAIN_AFTER_SECONDS", 0.0)
  with progress.step("tracing quantization rules"):
    pass
  assert err.getvalue() == ""
  with progress.step("validation 2/3: source unquantized", plain=True):
    assert err.getvalue() == ""  # the line comes once the pass is done, with its time
  assert re.fullmatch(r"validation 2/3: source unquantized… \d+\.\ds\n", err.getvalue())
  with pytest.raises(RuntimeError):
    with progress.step("validation 3/3: the export read back", plain=True):
      raise RuntimeError("a failed pass says so in its error line")
  assert err.getvalue().count("\n") == 1


def test_plain_steps_on_a_terminal_print_as_every_step(monkeypatch):
  err = _Terminal()
  monkeypatch.setattr("sys.stderr", err)
  with progress.step("forward pass", plain=True):
    assert err.getvalue() == "forward pass…"
  assert re.fullmatch(r"forward pass… \d+\.\ds\n", err.getvalue())
