"""`python -m inspect_tool` and the `inspect_checkpoint` script: the stop handlers first, then the command.

A stop signal before the command's own handling (while the handlers and the CLI are imported) ends the run in its
one line too. That exit is `os._exit`: a KeyboardInterrupt that passed through an `eval` of a string (a
`namedtuple` being built in an import) leaves CPython's "unhandled KeyboardInterrupt" flag set, and a normal exit
would then kill the process by SIGINT even though the exception was handled.
"""

import os


def _stop_of(exc: BaseException, stop) -> int | None:
  """The stop signal behind `exc`, or None when `exc` is an ordinary failure."""
  if isinstance(exc, KeyboardInterrupt):
    return 2  # SIGINT, before our handlers (Python's own)
  if stop is not None and stop.received() is not None:
    return stop.received()  # our handler's `Interrupted`, or what C++ code turned it into
  return getattr(exc, "signum", None)


def run() -> None:
  """Installs the stop handlers, imports the CLI and runs it; a stop during the first two is one line."""
  stop = None
  try:
    from inspect_tool.output import stop  # pylint: disable=import-outside-toplevel,redefined-outer-name
    stop.install_handlers()
    from inspect_tool import cli  # pylint: disable=import-outside-toplevel
  except BaseException as e:  # pylint: disable=broad-except
    signum = _stop_of(e, stop)
    if signum is None:
      raise
    import signal  # pylint: disable=import-outside-toplevel
    line = f"interrupted by {signal.Signals(signum).name}; nothing was left half-written"
    if stop is None:
      os.write(2, (line + "\n").encode())
    else:
      stop.report(line)  # unless the watchdog printed it already
    os._exit(128 + signum)  # pylint: disable=protected-access
  cli.entry_point()


if __name__ == "__main__":
  run()
