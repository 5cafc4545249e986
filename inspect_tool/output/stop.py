"""Stop signals: SIGTERM, SIGHUP, SIGINT and SIGQUIT (Ctrl-\\, by default a core dump) end a run cleanly (outputs
in progress removed, one line, 128+signal).

`install_handlers` makes each of them raise `errors.Interrupted` in the main thread (called at start-up and again
after JAX's distributed runtime, whose preemption notifier would take SIGTERM). The signal is also remembered:
- where Python would drop the exception: inside a gc callback (JAX's `_xla_gc_callback`), a `__del__` or an
  asyncio callback (Orbax's event loop, which logs it and goes on), and
  inside an import (where it can abort a C extension's initialisation or be printed as a traceback), the handler
  raises nothing and the signal is delivered again 50 ms later; anywhere else Python drops it (a weakref
  callback run by the collector), the `sys.unraisablehook` installed here (again if something replaced it) takes
  the dropped `Interrupted` silently and does the same;
- `check` raises it again at stage boundaries and before every commit, so a stopped run never commits;
- the main thread cannot run the handler while it is inside one long C++ call (an XLA compile takes seconds), and
  once it has, its way out can wait on threads blocked elsewhere (a worker in a network read that never ends): a
  watchdog thread, woken by the signal itself (`signal.set_wakeup_fd`, which writes before the handler runs: the
  watchdog records the signal itself), removes the outputs in progress (`add_cleanup`), prints the line and exits
  when the run has not ended `STOP_S` seconds after the signal, whatever the main thread is doing.
"""

from __future__ import annotations

import _thread
import gc
import os
import select
import signal
import sys
import threading
import time

from inspect_tool import process_state
from inspect_tool import errors

NAMES = ("SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT")
STOP_S = 4.0  # seconds a run has, from the stop signal, to remove its outputs and end: then the watchdog ends it
_received: list[int] = []  # the first stop signal, kept until the run ends
_cleanups: dict[int, object] = {}  # id -> callable, run by the watchdog before it exits
_report_lock = threading.Lock()
_reported: list[bool] = []  # whether the one line was printed
_watchdog: list[threading.Thread] = []
_runs = [0]  # bumped when a run ends (`clear`, `run_ended`): a watchdog counting down for it lets go
_stopped_run = [0]  # the value of `_runs` when the stop in `_received` arrived
_wakeups: list[int] = []  # the read end of the signals' wakeup pipe
_wakeup_lock = threading.Lock()  # the watchdog reads a signal's byte and records it as one step; `_drain` waits
# A run's stop and its cleanups; the watchdog, the run counter and the wakeup pipe are the process's own.
process_state.declare(f"{__name__}:_received,_cleanups,_reported,_watchdog,_runs,_stopped_run,_wakeups",
                      process_state.RUN, lambda: {k: v for k, v in (("received", list(_received)),
                                                                    ("cleanups", len(_cleanups))) if v})


def _received_now(signum: int) -> None:
  if not _received:
    _stopped_run[0] = _runs[0]
    _received.append(signum)


def _handler(signum, frame):
  _received_now(signum)
  if _swallowing(frame) or _importing(frame):  # raised here it would be dropped, or break a C extension's init
    _again_later(signum)
    return
  raise errors.Interrupted(signum)


_ASYNCIO_EVENTS = os.path.join("asyncio", "events.py")


def _swallowing(frame) -> bool:
  """Whether `frame` runs inside a gc callback, a finalizer or an asyncio callback, where exceptions are dropped."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
      return True
    if frame.f_code.co_name == "_run" and frame.f_code.co_filename.endswith(_ASYNCIO_EVENTS):
      return True  # an asyncio callback (Orbax's loop): asyncio logs a BaseException there and goes on
    frame = frame.f_back
  return False


def _importing(frame) -> bool:
  """Whether `frame` runs inside an import: an exception raised there can abort a C extension's initialisation
  (JAX's MLIR bindings) or be printed by the module's own handler, so the signal waits for the import to end."""
  while frame is not None:
    if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
      return True
    frame = frame.f_back
  return False


def _again_later(signum: int) -> None:
  """Delivers `signum` to the main thread again in 50 ms (its first exception was swallowed)."""
  timer = threading.Timer(0.05, _thread.interrupt_main, args=(signum,))
  timer.daemon = True
  timer.start()


def _install_unraisable_hook() -> None:
  """Wraps `sys.unraisablehook` (unless it is ours already) so that an `Interrupted` Python would drop is
  delivered again instead."""
  previous = sys.unraisablehook
  if getattr(previous, "redelivers_stops", False):
    return

  def hook(unraisable):
    if isinstance(unraisable.exc_value, errors.Interrupted):
      _again_later(unraisable.exc_value.signum)
    else:
      previous(unraisable)

  hook.redelivers_stops = True
  sys.unraisablehook = hook


def install_handlers() -> None:
  """The stop handlers (see the module docstring), and the watchdog; only from the main thread."""
  if threading.current_thread() is not threading.main_thread():
    return
  for name in NAMES:
    signal.signal(getattr(signal, name), _handler)
  _install_unraisable_hook()
  if not _watchdog:
    read, write = os.pipe()
    os.set_blocking(write, False)
    os.set_blocking(read, False)
    _wakeups.append(read)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    thread = threading.Thread(target=_watch, args=(read,), name="stop-watchdog", daemon=True)
    thread.start()
    _watchdog.append(thread)


def ignore_from_now() -> None:
  """The run is over (its output written, its exit code known): stop signals are ignored from now on, so one that
  arrives while the interpreter tears down (which puts back the default, killing action) changes nothing."""
  if threading.current_thread() is threading.main_thread():
    for name in NAMES:
      signal.signal(getattr(signal, name), signal.SIG_IGN)


def _watch(read: int) -> None:
  stops = {int(getattr(signal, name)) for name in NAMES}
  while True:
    select.select([read], [], [])
    with _wakeup_lock:
      try:
        data = os.read(read, 64)
      except BlockingIOError:  # drained by `run_ended` meanwhile
        continue
      if not data:
        return
      signum = next((b for b in data if b in stops), None)
      if signum is None:
        continue
      _received_now(signum)  # the byte comes before the handler runs: a stop it has not recorded yet is one still
    if not _still_stopping(STOP_S):
      continue  # a test went on (`clear`); a run that ended its own way is no longer here
    report(f"interrupted by {signal.Signals(signum).name}; nothing was left half-written")
    for cleanup in reversed(list(_cleanups.values())):  # the innermost output first, its lock last
      try:
        cleanup()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(128 + signum)  # pylint: disable=protected-access


def _still_stopping(seconds: float) -> bool:
  """Waits `seconds`; False as soon as the stopped run has ended (`clear`, `run_ended`), even if a later run in
  this process was stopped since."""
  run = _stopped_run[0]
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if not _received or _runs[0] != run:
      return False
    time.sleep(0.05)
  return bool(_received) and _runs[0] == run


def report(line: str) -> bool:
  """Prints the run's one stop line on stderr unless it was printed already; True if this call printed it."""
  with _report_lock:
    if _reported:
      return False
    _reported.append(True)
  os.write(2, (line + "\n").encode())
  # The stopped run's loops and files are torn down half-used: what their finalizers raise (an asyncio loop closed
  # mid-read) is noise under the line.
  sys.unraisablehook = lambda unraisable: None
  return True


def add_cleanup(fn) -> int:
  """Registers `fn` (remove an output in progress) for the watchdog; returns the key for `remove_cleanup`."""
  key = id(fn)
  _cleanups[key] = fn
  return key


def remove_cleanup(key: int) -> None:
  _cleanups.pop(key, None)


def received() -> int | None:
  """The stop signal that arrived in this run, or None."""
  return _received[0] if _received else None


def check() -> None:
  """Raises `errors.Interrupted` when a stop signal has arrived (even if its first exception was swallowed)."""
  if _received:
    raise errors.Interrupted(_received[0])


def clear() -> None:
  """Forgets a stop signal (a new run in the same process, e.g. tests calling `cli.main`)."""
  run_ended(forget=True)


def run_ended(forget: bool = False) -> None:
  """The run returned its own way (a test's in-process command): a watchdog counting down for it lets go, and the
  signals' bytes it has not read yet are dropped (read later, they would start a countdown for the next run);
  `received` still names the stop that ended it unless `forget`."""
  with _wakeup_lock:
    for read in _wakeups:
      try:
        while os.read(read, 4096):
          pass
      except BlockingIOError:
        pass
    if forget:
      _received.clear()
      _reported.clear()
    _runs[0] += 1
