"""Errors a user can fix. The CLI prints these as one line and exits non-zero, without a traceback."""
from __future__ import annotations

import errno
import os


class UserError(Exception):
  """Bad input or environment: the message says what was wrong and what to do."""

  exit_code = 2


_OS_HINTS = {
  errno.ENOSPC: "the disk is full; free space or choose another output",
  errno.EDQUOT: "the disk quota is used up; free space or choose another output",
  errno.EFBIG: "the file is larger than this process may write (a file-size limit); free space or raise the limit",
  errno.EROFS: "the file system is read-only; choose a writable output",
  errno.EACCES: "permission denied; choose a path you may write (or read)",
  errno.EPERM: "operation not permitted; choose a path you may write (or read)",
  errno.EISDIR: "that is a folder where a file is expected; give a file path",
  errno.ENOTDIR: "a part of that path is a file where a folder is expected; choose another path",
  errno.EEXIST: "that path exists already; remove it or choose another",
  errno.ENOENT: "no such file or folder; check the path",
  errno.ENAMETOOLONG: "the path is too long; choose a shorter one",
  errno.ENOTEMPTY: "the folder is not empty; choose an empty or new one",
}


def describe_os_error(e: OSError) -> str | None:
  """One line for an OSError on a path the user named (read-only, full, a file where a folder should be...), or None when it
  names no path: that one is a bug, and its traceback is the useful report."""
  path = e.filename
  if path is None:
    # a full disk or a file-size limit hit inside a library's write names no file; it is still the output's fault, not a bug
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
      return f"{e.strerror or type(e).__name__} while writing the output ({_OS_HINTS[e.errno]})"
    return None
  where = f"{os.fsdecode(path)}" + (f" -> {os.fsdecode(e.filename2)}" if e.filename2 is not None else "")
  hint = _OS_HINTS.get(e.errno or -1, "check the path and try again")
  return f"{where}: {e.strerror or type(e).__name__} ({hint})"
