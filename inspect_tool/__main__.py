"""`python -m inspect_tool` runs the `inspect_checkpoint` command."""

import signal
import sys

try:
  from inspect_tool.output import stop
except KeyboardInterrupt:  # Ctrl-C in the first milliseconds, before our handlers
  sys.stderr.write("interrupted by SIGINT; nothing was left half-written\n")
  sys.exit(130)

stop.install_handlers()  # first: a stop signal during the imports below ends the run in one line too
try:
  from inspect_tool import cli  # pylint: disable=ungrouped-imports
except BaseException:  # pylint: disable=broad-except
  if stop.received() is None:
    raise
  stop.report(f"interrupted by {signal.Signals(stop.received()).name}; nothing was left half-written")
  sys.exit(128 + stop.received())

cli.entry_point()
