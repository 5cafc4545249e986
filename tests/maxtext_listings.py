"""MaxText 0.2.5's parameter listings in tests/data/listings/ (see its README): parsed entries and the model keys of
the MaxText command that wrote each file (its line 1)."""

import pathlib
import re
from conftest import DATA

LISTINGS = pathlib.Path(DATA) / "listings"
LINE = re.compile(r"key: (\S+) \| shape: \(([\d, ]*)\) \| dtype: (\w+)")


def entries(name: str) -> set[tuple[str, tuple[int, ...], str]]:
  """{(dotted key, shape, dtype)} of every `key: ... | shape: ... | dtype: ...` line."""
  out = set()
  for line in (LISTINGS / name).read_text().splitlines():
    match = LINE.match(line)
    if match:
      shape = tuple(int(d) for d in match.group(2).replace(" ", "").split(",") if d)
      out.add((match.group(1), shape, match.group(3)))
  return out


def model_keys(name: str) -> list[str]:
  """The `key=value` arguments of MaxText's command on line 1 (between `maxtext` and the first `--` option)."""
  command = (LISTINGS / name).read_text().splitlines()[0]
  return command.split(" maxtext ", 1)[1].split(" --", 1)[0].split()
