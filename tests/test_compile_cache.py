"""JAX's persistent compilation cache (`inspect_tool.run.compile_cache`): a second `forward` in a fresh process loads
every compiled program from the cache (JAX's own cache-hit log, no new entries); `--no-compile-cache` and
`INSPECT_CHECKPOINT_COMPILE_CACHE=0` leave the directory alone; an unwritable directory costs one warning line, not
the run; an entry is never left half-written (file-size limit)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys

import pytest

from inspect_tool.run import compile_cache

import hostile

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
FORWARD = ["forward", *hostile.TINY_CKPT_MODEL, "quantization=fp8_full", "quantize_mtp=true", "--checkpoint", CKPT]

# The CLI in a child process with JAX's compiler logging at DEBUG: its cache hits and misses, one line each.
_LOGGED_CLI = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="jaxlog: %(message)s")
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
from inspect_tool import cli
sys.exit(cli.main(sys.argv[1:]))
"""
# The CLI's option handling (`model_name=none` then fails: exit 2), then one small jitted program.
_CLI_THEN_JIT = """
import sys
from inspect_tool import cli
assert cli.main(sys.argv[1:]) == 2
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) * 3)(1.0)))
"""
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
_MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")


def _run(code: str, args, cache_dir, *, preexec_fn=None, **env):
  inherited = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}  # the user's opt-out does not apply
  env = dict(inherited, JAX_PLATFORMS="cpu", **{compile_cache.JAX_ENV: str(cache_dir)}, **env)
  return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, env=env,
                        check=False, timeout=600, preexec_fn=preexec_fn)


def _entries(cache_dir) -> set[str]:
  return {n for n in os.listdir(cache_dir) if n.endswith("-cache")} if os.path.isdir(cache_dir) else set()


def test_second_forward_loads_every_compiled_program_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  first = _run(_LOGGED_CLI, FORWARD, cache)
  assert first.returncode == 0, first.stderr[-3000:]
  compiled = _MISS.findall(first.stderr)
  written = _entries(cache)
  assert "jit_pure_forward" in compiled and not _HIT.findall(first.stderr)
  assert {name.rsplit("-", 2)[0] for name in written} == set(compiled)  # every compiled program was kept

  second = _run(_LOGGED_CLI, FORWARD, cache)
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(_HIT.findall(second.stderr)) == sorted(compiled) and not _MISS.findall(second.stderr)
  assert _entries(cache) == written  # nothing compiled, nothing new
  assert second.stdout == first.stdout and "main loss" in first.stdout


@pytest.mark.parametrize("opt_out", ["flag", "variable"])
def test_opting_out_leaves_the_cache_directory_alone(tmp_path, opt_out):
  cli_args = ["forward", "model_name=none"]
  kept = _run(_CLI_THEN_JIT, cli_args, tmp_path / "on")
  assert kept.returncode == 0, kept.stderr[-3000:]
  assert len(_entries(tmp_path / "on")) == 1  # the control: the small program was kept
  if opt_out == "flag":
    off = _run(_CLI_THEN_JIT, cli_args + ["--no-compile-cache"], tmp_path / "off")
  else:
    off = _run(_CLI_THEN_JIT, cli_args, tmp_path / "off", **{compile_cache.ENV: "0"})
  assert off.returncode == 0, off.stderr[-3000:]
  assert off.stdout == kept.stdout and _entries(tmp_path / "off") == set()


def test_unwritable_cache_directory_is_one_warning_line_and_the_run_goes_on(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  out = _run(_LOGGED_CLI, FORWARD + ["--quiet"], blocker / "cache")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "main loss" in out.stdout
  lines = [line for line in out.stderr.splitlines() if not line.startswith("jaxlog: ")]
  assert len(lines) == 1 and lines[0].startswith(f"warning: compilation cache off: cannot write {blocker / 'cache'}")
  assert not _HIT.findall(out.stderr) and not _MISS.findall(out.stderr)  # the cache was not consulted


def _small_files_only():
  """In the child: files may not grow past 1000 bytes (a full disk, or quota, as a write sees it)."""
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))


def test_an_entry_that_cannot_be_written_whole_leaves_nothing_and_the_next_run_writes_it(tmp_path):
  code = "import sys\nfrom inspect_tool.run import compile_cache\ncompile_cache.configure()\n" + _CLI_THEN_JIT.split(
      "assert cli.main(sys.argv[1:]) == 2\n")[1]
  cache = tmp_path / "cache"
  cut = _run(code, [], cache, preexec_fn=_small_files_only)
  assert cut.returncode == 0, cut.stderr[-3000:]
  assert "Error writing persistent compilation cache entry" in cut.stderr  # JAX's warning: the entry is too large
  assert os.listdir(cache) == []  # no truncated entry, no temporary file
  again = _run(code, [], cache)
  assert again.returncode == 0 and again.stdout == cut.stdout, again.stderr[-3000:]
  assert "Error reading" not in again.stderr and len(_entries(cache)) == 1


def test_cache_directory_follows_jax_then_xdg_then_home(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.JAX_ENV, raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.directory() == str(tmp_path / "home" / ".cache" / "inspect_checkpoint" / "jax")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.directory() == str(tmp_path / "xdg" / "inspect_checkpoint" / "jax")
  monkeypatch.setenv(compile_cache.JAX_ENV, str(tmp_path / "mine"))
  assert compile_cache.directory() == str(tmp_path / "mine")


def test_a_variable_that_is_neither_on_nor_off_is_one_line_exit_2(capsys, monkeypatch):
  monkeypatch.setenv(compile_cache.ENV, "sometimes")
  hostile.refused(capsys, ["forward", "model_name=deepseek3-tiny"], f"{compile_cache.ENV}='sometimes'",
                  "accepted: 0, false, off, no (off) or 1, true, on, yes")
