"""Errors a user can fix. The CLI prints these as one line and exits non-zero, without a traceback."""


class UserError(Exception):
  """Bad input or environment: the message says what was wrong and what to do."""

  exit_code = 2
