"""Errors raised by `quant`: bad rules, bad rule files, bad quantization settings (one-line messages)."""


class QuantError(ValueError):
  """A quantization rule, rule file or setting is invalid; the message names it and what is accepted."""

  exit_code = 2
