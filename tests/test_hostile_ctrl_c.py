"""Ctrl-C (SIGINT) at any moment of a `forward` run, from the interpreter's first imports to the end, as an impatient
user presses it: the run ends in one line, "interrupted by SIGINT; nothing was left half-written", exit 130 (or, when
the key came after the work, its normal output and exit 0): never a traceback, an abort or a silent death by the
signal. The instants cover the imports (numpy's and JAX's C extensions, where a raised exception aborts or is
printed), Orbax's asyncio restore, the compile and the interpreter's teardown.
"""

import signal
import subprocess
import sys

import pytest

from test_export_kill import CKPT, REPO, _env

KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
LINE = "interrupted by SIGINT; nothing was left half-written\n"


def _default_sigint():
  signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's foreground job has it (CI's shell may ignore it)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.03, 0.06, 0.09, 0.12, 0.15, 0.2, 0.3, 0.5, 0.8, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5])
def test_ctrl_c_at_any_moment_of_a_forward_run_is_one_line(after_s):
  proc = subprocess.Popen([sys.executable, "-m", "inspect_tool", "forward", *KEYS, "--checkpoint", CKPT],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(),
                          preexec_fn=_default_sigint)
  try:
    proc.wait(timeout=after_s)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  if proc.returncode == 0:  # the work was done first
    assert err == "" and out, err
  else:
    assert (proc.returncode, err) == (130, LINE), (proc.returncode, err[-3000:])
