"""The MSM patch series against tinygrad 0.14.0's QCOM driver: apply it, turn it into a git tree to edit, export it back.

  python upstream/series.py apply DIR    copy the installed tinygrad 0.14.0 into DIR and apply the series (DIR/tinygrad)
  python upstream/series.py tree DIR     the same as a git repo, one commit per patch, to edit the series
  python upstream/series.py export DIR   write DIR's commits since the pristine copy back as upstream/patches/*.patch,
                                         with patch 3's msm UAPI header regenerated from backend/uapi.py
  python upstream/series.py check        the series' msm UAPI header is the one backend/uapi.py generates
  python upstream/series.py stat         files and lines added/removed per patch

The msm UAPI header of patch 3 (`tinygrad/runtime/autogen/msm.py`) is not written by hand: `autogen_msm()` writes it in
the form of tinygrad's generated headers from the layouts our backend runs on (backend/uapi.py), so the two cannot differ.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCHES = HERE / "patches"
AUTOGEN = "tinygrad/runtime/autogen/msm.py"
TINYGRAD_VERSION = "0.14.0"

# what patch 3's MSMIface uses of msm_drm.h (and of drm.h, which it includes), in the header's order
STRUCTS = ("drm_version", "drm_gem_close", "drm_msm_timespec", "drm_msm_param", "drm_msm_gem_new", "drm_msm_gem_info",
           "drm_msm_gem_submit_cmd", "drm_msm_gem_submit_bo", "drm_msm_gem_submit", "drm_msm_wait_fence", "drm_msm_submitqueue")
IOCTLS = {"VERSION": "drm_version", "GEM_CLOSE": "drm_gem_close", "MSM_GET_PARAM": "drm_msm_param", "MSM_GEM_NEW": "drm_msm_gem_new",
          "MSM_GEM_INFO": "drm_msm_gem_info", "MSM_GEM_SUBMIT": "drm_msm_gem_submit", "MSM_WAIT_FENCE": "drm_msm_wait_fence",
          "MSM_SUBMITQUEUE_NEW": "drm_msm_submitqueue"}
CONSTANTS = ("MSM_PIPE_3D0", "MSM_PARAM_GPU_ID", "MSM_PARAM_CHIP_ID", "MSM_PARAM_PRIORITIES", "MSM_BO_WC", "MSM_INFO_GET_OFFSET",
             "MSM_INFO_GET_IOVA", "MSM_SUBMIT_CMD_BUF", "MSM_SUBMIT_BO_READ", "MSM_SUBMIT_BO_WRITE", "MSM_SUBMIT_NO_IMPLICIT")
_CTYPES = {ctypes.c_uint32: "ctypes.c_uint32", ctypes.c_int32: "ctypes.c_int32", ctypes.c_uint64: "ctypes.c_uint64",
           ctypes.c_int64: "ctypes.c_int64"}
_DIRS = {0: "_IO", 1: "_IOW", 2: "_IOR", 3: "_IOWR"}


class SeriesError(Exception):
  pass


def installed_tinygrad() -> Path:
  """The site-packages folder holding the installed tinygrad package (refused unless it is 0.14.0)."""
  import importlib.metadata
  import importlib.util
  if (v := importlib.metadata.version("tinygrad")) != TINYGRAD_VERSION:
    raise SeriesError(f"the series is against tinygrad {TINYGRAD_VERSION}, found {v}; pip install tinygrad=={TINYGRAD_VERSION}")
  spec = importlib.util.find_spec("tinygrad")
  if spec is None or spec.origin is None:
    raise SeriesError("tinygrad is not importable here")
  return Path(spec.origin).parent.parent


def patches() -> list[Path]:
  found = sorted(PATCHES.glob("*.patch"))
  if not found:
    raise SeriesError(f"no patches in {PATCHES}")
  return found


def _c_name(t) -> str:
  if t in _CTYPES:
    return _CTYPES[t]
  if isinstance(t, type) and issubclass(t, ctypes.Structure):
    return f"struct_{t.__name__}"
  raise SeriesError(f"no autogen spelling for {t!r}")


def autogen_msm() -> str:
  """tinygrad/runtime/autogen/msm.py, in the form of tinygrad's generated headers, from backend/uapi.py's layouts."""
  from backend import uapi as u
  out = ['# mypy: disable-error-code="empty-body"', "from __future__ import annotations", "import ctypes",
         "from tinygrad.runtime.support.c import _IO, _IOW, _IOR, _IOWR", "from tinygrad.runtime.support import c"]
  for name in STRUCTS:
    st = getattr(u, name)
    fields = [(f, t) for f, t, *_ in st._fields_]
    out += ["@c.record", f"class struct_{name}(c.Struct):", f"  SIZE = {ctypes.sizeof(st)}"]
    out += [f"  {f}: {'struct_' + t.__name__ if issubclass(t, ctypes.Structure) else 'int'}" for f, t in fields]
    regs = ", ".join(f"({f!r}, {_c_name(t)}, {getattr(st, f).offset})" for f, t in fields)
    out.append(f"struct_{name}.register_fields([{regs}])")
  out += ["DRM_IOCTL_BASE = 'd'", f"DRM_COMMAND_BASE = {u.DRM_COMMAND_BASE:#x}"]
  for name, st in IOCTLS.items():
    req = getattr(u, f"DRM_IOCTL_{name}")
    d, size, nr = req >> 30, (req >> 16) & 0x3fff, req & 0xff
    if ctypes.sizeof(getattr(u, st)) != size:
      raise SeriesError(f"DRM_IOCTL_{name} is for {size} bytes, {st} has {ctypes.sizeof(getattr(u, st))}")
    nr_text = f"DRM_COMMAND_BASE + {nr - u.DRM_COMMAND_BASE:#04x}" if nr >= u.DRM_COMMAND_BASE else f"{nr:#04x}"
    out.append(f"DRM_IOCTL_{name} = {_DIRS[d]}(DRM_IOCTL_BASE, {nr_text}, struct_{st})")
  out += [f"{k} = {getattr(u, k):#x}" for k in CONSTANTS]
  return "\n".join(out) + "\n"


def _git(cwd: Path, *args: str, inp: str | None = None) -> str:
  r = subprocess.run(["git", "-c", "user.name=modeld-msm", "-c", "user.email=modeld-msm@localhost", "-c", "core.autocrlf=false", *args],
                     cwd=cwd, capture_output=True, text=True, input=inp)
  if r.returncode != 0:
    raise SeriesError(f"git {' '.join(args[:2])} in {cwd} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
  return r.stdout


def _pristine(dest: Path) -> None:
  if dest.exists() and any(dest.iterdir()):
    raise SeriesError(f"{dest} is not empty; give a new folder")
  dest.mkdir(parents=True, exist_ok=True)
  shutil.copytree(installed_tinygrad() / "tinygrad", dest / "tinygrad", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  _git(dest, "init", "-q")
  _git(dest, "add", "-A")
  _git(dest, "commit", "-q", "-m", f"tinygrad {TINYGRAD_VERSION} as released")
  _git(dest, "tag", "pristine")


def tree(dest: Path) -> Path:
  """A git repo at dest: the pristine tinygrad package, then one commit per patch of the series."""
  _pristine(dest)
  for p in patches():
    _git(dest, "am", "-q", "--keep-cr", str(p))
  return dest


def apply(dest: Path, upto: int | None = None) -> Path:
  """The installed tinygrad 0.14.0 copied into dest/tinygrad with the series (its first `upto` patches) applied in order."""
  _pristine(dest)
  for p in patches()[:upto]:
    _git(dest, "apply", "--whitespace=nowarn", str(p))
  return dest


def patched_autogen(patch: Path) -> str | None:
  """The content of the msm UAPI header as a patch creates it (None if the patch does not create it)."""
  text = patch.read_text()
  m = re.search(rf"^diff --git a/{re.escape(AUTOGEN)} b/{re.escape(AUTOGEN)}\nnew file mode .*?\n.*?^@@ [^\n]*@@\n(.*?)(?=^diff --git |^-- \n|\Z)",
                text, re.S | re.M)
  if m is None:
    return None
  return "".join(line[1:] + "\n" for line in m.group(1).splitlines() if line.startswith("+"))


def check() -> list[str]:
  """Where the series' msm UAPI header differs from what backend/uapi.py generates (empty: none)."""
  found = [(p, t) for p in patches() if (t := patched_autogen(p)) is not None]
  if len(found) != 1:
    return [f"{len(found)} patches create {AUTOGEN}; expected exactly one"]
  want = autogen_msm()
  if found[0][1] != want:
    return [f"{found[0][0].name}: {AUTOGEN} is not what backend/uapi.py generates; run `python upstream/series.py export DIR` on a tree"]
  return []


def export(src: Path) -> list[Path]:
  """src's commits since `pristine` as upstream/patches/NNNN-*.patch; the msm UAPI header is regenerated first."""
  hdr = src / AUTOGEN
  if hdr.exists() and hdr.read_text() != autogen_msm():
    hdr.write_text(autogen_msm())
    raise SeriesError(f"{AUTOGEN} in {src} was not backend/uapi.py's: rewritten from it; commit that into the patch that creates it, then export")
  out = PATCHES
  for old in out.glob("*.patch"):
    old.unlink()
  _git(src, "format-patch", "-q", "--zero-commit", "--no-signature", "--full-index", "-o", str(out), "pristine..HEAD")
  return sorted(out.glob("*.patch"))


def stat() -> list[tuple[str, int, int, int]]:
  """(patch, files, lines added, lines removed) per patch, counted from its diff."""
  rows = []
  for p in patches():
    files = add = rem = 0
    in_diff = False
    for line in p.read_text().splitlines():
      if line.startswith("diff --git "):
        files, in_diff = files + 1, True
      elif line == "-- " and in_diff:
        in_diff = False
      elif in_diff and line.startswith("+") and not line.startswith("+++ "):
        add += 1
      elif in_diff and line.startswith("-") and not line.startswith("--- "):
        rem += 1
    rows.append((p.name, files, add, rem))
  return rows


def main(argv: list[str]) -> int:
  if len(argv) < 1 or argv[0] not in ("apply", "tree", "export", "check", "stat") or (argv[0] in ("apply", "tree", "export")) != (len(argv) == 2):
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2
  try:
    if argv[0] == "apply":
      print(apply(Path(argv[1])) / "tinygrad")
    elif argv[0] == "tree":
      print(tree(Path(argv[1])))
    elif argv[0] == "export":
      for p in export(Path(argv[1])):
        print(p)
    elif argv[0] == "check":
      if errs := check():
        print("\n".join(errs), file=sys.stderr)
        return 1
      print("OK: the series' msm UAPI is backend/uapi.py's")
    else:
      for name, files, add, rem in stat():
        print(f"{name}: {files} file(s), +{add} -{rem}")
  except (SeriesError, OSError) as e:
    print(f"series: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.path.insert(0, str(HERE.parent))   # backend/ for the UAPI layouts
  sys.exit(main(sys.argv[1:]))
