"""Errors raised by `quant`: bad rules, bad rule files, bad quantization settings (one-line messages)."""


class QuantError(ValueError):
  """A quantization rule, rule file or setting is invalid; the message names it and what is accepted."""

  exit_code = 2


def exception_chain(e: BaseException | None) -> list[BaseException]:
  """`e` and every exception behind it (`__cause__`, else `__context__`), outermost first, cycles cut."""
  seen, chain = set(), []
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  return chain
