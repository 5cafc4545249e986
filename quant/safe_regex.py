"""Refuses module-path regexes whose matching can take exponential (or huge polynomial) time.

Qwix matches each rule's `module_path` with `re.fullmatch` against every module path while tracing, and
Python's backtracking engine cannot be given a time limit there, so a pattern such as `(.|.)*Z` would spin
for ever. Patterns from rule files are therefore checked when they are read, in two ways:

1. structurally (the parsed pattern): a repetition (`*`, `+`, `{n,}`) whose body holds another repetition
   not closed off by a character it cannot consume (`(a+)+`, but not `(\\w+/)*`), or alternatives that can
   start with the same character (`(.|.)*`, `(ab|a.)*`);
2. by measurement: the pattern is run on probe strings as long as a long module path, built from its own
   characters, with a `PROBE_SECONDS` budget (an interval timer; on the main thread only).

Either refusal raises `ValueError` with a one-line reason. The check is conservative, not a proof: a pattern
that passes both ran fast on every probe.
"""

from __future__ import annotations

import re
import signal
import threading

from quant import compat

sre_parse, sre_constants = compat.regex_internals()

PROBE_LENGTH = 160  # longer than any module path of the models here (< 100 characters)
PROBE_SECONDS = 0.25
_ALPHABET = range(256)
_ALL = frozenset(_ALPHABET)
_MANY = 16  # a repetition allowing more than this many iterations counts as unbounded
_C = sre_constants
_REPEATS = {_C.MAX_REPEAT, _C.MIN_REPEAT} | ({_C.POSSESSIVE_REPEAT} if hasattr(_C, "POSSESSIVE_REPEAT") else set())
_CATEGORIES = {
    _C.CATEGORY_DIGIT: str.isdigit, _C.CATEGORY_SPACE: str.isspace,
    _C.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
}


def _category(cat) -> frozenset:
  for base, test in _CATEGORIES.items():
    if cat == base:
      return frozenset(i for i in _ALPHABET if test(chr(i)))
  negated = {_C.CATEGORY_NOT_DIGIT: _C.CATEGORY_DIGIT, _C.CATEGORY_NOT_SPACE: _C.CATEGORY_SPACE,
             _C.CATEGORY_NOT_WORD: _C.CATEGORY_WORD}
  return _ALL - _category(negated[cat]) if cat in negated else _ALL


def _chars(op, av) -> frozenset | None:
  """The characters (of the first 256) one single-character item matches; None if `op` is not one."""
  if op == _C.LITERAL:
    return frozenset({av}) if av < 256 else frozenset()
  if op == _C.NOT_LITERAL:
    return _ALL - {av}
  if op == _C.ANY:
    return _ALL
  if op == _C.IN:
    chars, negate = set(), False
    for sub_op, sub_av in av:
      if sub_op == _C.NEGATE:
        negate = True
      elif sub_op == _C.LITERAL:
        chars.add(sub_av)
      elif sub_op == _C.RANGE:
        chars.update(range(sub_av[0], min(sub_av[1], 255) + 1))
      elif sub_op == _C.CATEGORY:
        chars.update(_category(sub_av))
      else:
        return _ALL
    return _ALL - chars if negate else frozenset(chars)
  return None


def _first(seq) -> tuple[frozenset, bool]:
  """(characters a match of `seq` can start with, whether `seq` can match the empty string)."""
  acc: set = set()
  for op, av in seq:
    chars = _chars(op, av)
    if chars is not None:
      return frozenset(acc | chars), False
    if op == _C.SUBPATTERN:
      first, nullable = _first(av[-1])
    elif op == _C.BRANCH:
      parts = [_first(alt) for alt in av[1]]
      first, nullable = frozenset().union(*(p[0] for p in parts)), any(p[1] for p in parts)
    elif op in _REPEATS:
      first, nullable = _first(av[2])
      nullable = nullable or av[0] == 0
    elif op in (_C.AT, _C.ASSERT, _C.ASSERT_NOT):
      first, nullable = frozenset(), True
    else:  # back-references, conditionals, atomic groups: assume the worst
      first, nullable = _ALL, True
    acc |= first
    if not nullable:
      return frozenset(acc), False
  return frozenset(acc), True


def _consumed(seq) -> frozenset:
  """Every character some single-character item anywhere in `seq` can consume."""
  acc: set = set()
  for op, av in seq:
    chars = _chars(op, av)
    if chars is not None:
      acc |= chars
    elif op == _C.SUBPATTERN:
      acc |= _consumed(av[-1])
    elif op == _C.BRANCH:
      for alt in av[1]:
        acc |= _consumed(alt)
    elif op in _REPEATS:
      acc |= _consumed(av[2])
    elif op not in (_C.AT, _C.ASSERT, _C.ASSERT_NOT):
      return _ALL
  return frozenset(acc)


def _structural_problem(seq, repeated: bool) -> str | None:
  """Why `seq` (inside an unbounded repetition when `repeated`) can backtrack catastrophically, or None."""
  items = list(seq)
  for index, (op, av) in enumerate(items):
    if op in _REPEATS:
      if repeated and av[1] > 1:
        after = items[index + 1:] + items[:index + 1]  # what must follow, wrapping round the outer body
        first, nullable = _first(after)
        if nullable or first & _consumed(av[2]):
          return "a repetition inside a repetition"
      problem = _structural_problem(av[2], repeated or av[1] > _MANY)
    elif op == _C.SUBPATTERN:
      problem = _structural_problem(av[-1], repeated)
    elif op == _C.BRANCH:
      alternatives = [_first(alt) for alt in av[1]]
      if repeated:
        for i, (first_i, null_i) in enumerate(alternatives):
          for first_j, null_j in alternatives[i + 1:]:
            if (first_i & first_j) or (null_i and null_j):
              return "a repetition of alternatives that can match the same text"
      problem = next((p for p in (_structural_problem(alt, repeated) for alt in av[1]) if p), None)
    else:
      problem = None
    if problem:
      return problem
  return None


class _OverBudget(Exception):
  pass


def _probes(pattern: str) -> list[str]:
  chars = sorted({c for c in pattern if c.isprintable()} | set("a_/0."))
  half = PROBE_LENGTH // 2
  out = []
  for c in chars:
    out += [c * PROBE_LENGTH, c * PROBE_LENGTH + "\x00", (c + "/") * half + "\x00"]
  out.append("mtp_block/mtp_layer_1/" * (PROBE_LENGTH // 22) + "\x00")
  return out


def _measured_problem(compiled: re.Pattern) -> str | None:
  if threading.current_thread() is not threading.main_thread():
    return None

  def expire(*_):
    raise _OverBudget()

  previous = signal.signal(signal.SIGALRM, expire)
  old_timer = signal.setitimer(signal.ITIMER_REAL, PROBE_SECONDS)
  try:
    for probe in _probes(compiled.pattern):
      compiled.fullmatch(probe)
      compiled.search(probe)
  except _OverBudget:
    return f"matching a {PROBE_LENGTH}-character path took over {PROBE_SECONDS} s"
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    if old_timer[0]:
      signal.setitimer(signal.ITIMER_REAL, *old_timer)
  return None


def check(pattern: str) -> re.Pattern:
  """The compiled pattern; `ValueError` naming why when it is invalid or may backtrack catastrophically."""
  try:
    compiled = re.compile(pattern)
    parsed = sre_parse.parse(pattern)
  except re.error as e:
    raise ValueError(f"invalid regex: {e}") from None
  except RecursionError:
    raise ValueError("regex nests too deeply") from None
  try:
    problem = _structural_problem(parsed, False)
  except RecursionError:
    problem = "regex nests too deeply"
  problem = problem or _measured_problem(compiled)
  if problem:
    raise ValueError(f"may backtrack catastrophically ({problem}); rewrite it without nested or "
                     "overlapping repetition")
  return compiled
