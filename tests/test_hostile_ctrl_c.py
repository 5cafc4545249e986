"""Ctrl-C (SIGINT) at any moment of a `forward` run, from our first line to the end, as an impatient user presses it:
the run ends in one line, "interrupted by SIGINT; nothing was left half-written", exit 130 (or, when the key came
after the work, its normal output and exit 0): never a traceback, an abort or a silent death by the signal. The
instants count from the moment our stop handlers are in place (read from /proc: the process catches SIGQUIT, which
Python itself leaves alone) and cover the imports (the CLI's, numpy's and JAX's C extensions, where a raised
exception aborts or is printed), Orbax's asyncio restore, the compile and the interpreter's teardown. Before that
moment the interpreter runs its own start-up (site, the package's import: about 20 ms here) and a Ctrl-C there
is Python's to answer, with its traceback.
"""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_export_kill import CKPT, REPO, _env

pytestmark = pytest.mark.slow  # stress: repeated SIGINTs at every moment of a run (.ci/run: once)

KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
LINE = "interrupted by SIGINT; nothing was left half-written\n"


def _default_sigint():
  signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's foreground job has it (CI's shell may ignore it)


def _catches_sigquit(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
  except (OSError, StopIteration):
    return False
  return bool(caught & (1 << (signal.SIGQUIT - 1)))


def _when_handled(proc, deadline_s: float = 30.0) -> None:
  """Returns once `proc` has our stop handlers in place (or has ended)."""
  end = time.monotonic() + deadline_s
  while proc.poll() is None and not _catches_sigquit(proc.pid):
    assert time.monotonic() < end, "the stop handlers were never installed"
    time.sleep(0.0005)


@pytest.mark.parametrize("after_s", [0.0, 0.002, 0.005, 0.01, 0.03, 0.06, 0.09, 0.12, 0.15, 0.2, 0.3, 0.5, 0.8, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5])
def test_ctrl_c_at_any_moment_of_a_forward_run_is_one_line(after_s):
  proc = subprocess.Popen([sys.executable, "-m", "inspect_tool", "forward", *KEYS, "--checkpoint", CKPT],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(),
                          preexec_fn=_default_sigint)
  _when_handled(proc)
  try:
    proc.wait(timeout=after_s)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  if proc.returncode == 0:  # the work was done first
    assert err == "" and out, err
  else:
    assert (proc.returncode, err) == (130, LINE), (proc.returncode, err[-3000:])


def test_a_ctrl_c_caught_inside_an_eval_before_our_handlers_still_exits_130_not_by_the_signal(tmp_path):
  """A KeyboardInterrupt that passes through `eval` of a string (as `namedtuple` builds its class inside an import)
  sets CPython's "unhandled KeyboardInterrupt" flag even when it is then handled, and `python -m` then ends by
  SIGINT (-2) instead of its exit code. Here a `sitecustomize` raises the interrupt that way while
  `inspect_tool.output.stop` is imported, before any of our handlers."""
  (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
      import sys
      class Finder:
        def find_spec(self, name, path=None, target=None):
          if name == "inspect_tool.output.stop":
            eval("(_ for _ in ()).throw(KeyboardInterrupt)")
      sys.meta_path.insert(0, Finder())
  """))
  proc = subprocess.run([sys.executable, "-m", "inspect_tool", "--help"], capture_output=True, text=True, cwd=REPO,
                        env=_env(PYTHONPATH=str(tmp_path)), timeout=60, check=False)
  assert (proc.returncode, proc.stderr, proc.stdout) == (130, LINE, "")
