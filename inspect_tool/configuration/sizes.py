"""Byte sizes given on the command line (`--max-memory`, `--device-memory`): strict, exact, in range.

A size is digits with an optional fraction and an optional unit (one space may separate them), nothing else:
no leading or trailing spaces, signs, exponents, `nan` or `inf` (`' 600 MB '` is refused). The value is
computed exactly (no float rounding or overflow: a 400-digit number is refused in one line, not an
`OverflowError`) and must come out between 1 byte and `MAX_BYTES`.
"""

from __future__ import annotations

import fractions
import re

from inspect_tool import errors

MAX_BYTES = 2**60  # 1 EiB: more than any host or device has
_SIZE = re.compile(r"([0-9]{1,19}(?:\.[0-9]{1,19})?)(?: ?([A-Za-z]{1,3}))?")
DECIMAL_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
                 "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text, option: str, units: dict[str, int], error: type[Exception] = errors.InputError,
               examples: str = "600MB, 2GiB, 1.5G") -> int:
  """Bytes of `text` (`600MB`, `2GiB`, `1.5G`, `1000000`) under the unit table `units` (lower-case keys).

  Raises:
    error: not such a size, or not between 1 byte and `MAX_BYTES`; the line names `option` and the value.
  """
  value = str(text)
  match = _SIZE.fullmatch(value) if len(value) <= 64 else None
  unit = (match.group(2) or "").lower() if match else None
  if not match or unit not in units:
    raise error(f"{option} {errors.shown(value)} is not a size; accepted: a positive number with an optional "
                f"unit, e.g. {examples}")
  nbytes = int(fractions.Fraction(match.group(1)) * units[unit])
  if not 1 <= nbytes <= MAX_BYTES:
    raise error(f"{option} {errors.shown(value)} is {'under 1 byte' if nbytes < 1 else 'over 1 EiB'}; accepted: "
                f"a size from 1 byte to 1 EiB ({MAX_BYTES} bytes), e.g. {examples}")
  return nbytes
