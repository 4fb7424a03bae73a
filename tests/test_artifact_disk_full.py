"""Disk full while writing an artifact (issue 11's fault matrix): a clear error, a non-zero exit, and nothing half-written left
behind: no partial artifact directory, no temp dirs, no parent folders made for it, an artifact already there unchanged.

No small tmpfs on this box: RLIMIT_FSIZE with SIGXFSZ ignored makes a write past the limit fail with EFBIG, as a full disk
fails with ENOSPC (tests/test_faults.py does the same for replay output). The limit applies to the child only.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _limited(limit_bytes: int):
  def pre() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
  return pre


def _files(root: Path) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


WRITE = textwrap.dedent("""
  import sys
  sys.path.insert(0, {repo!r})
  from artifact.format import write_artifact
  from artifact.kinds import POLICY_PKL, WARP_PKL
  from selfdrive_glue.errors import UserError
  try:
    write_artifact({out!r}, {{POLICY_PKL: bytes(range(256)) * 4096, WARP_PKL: b"w" * 1000}}, {{"format": 1}})
  except UserError as e:
    print("USERERROR", e)
    sys.exit(e.exit_code)
  print("WROTE")
""")


@pytest.mark.parametrize("existing", [False, True])
def test_write_artifact_disk_full_leaves_nothing_half_written(tmp_path, existing):
  out = tmp_path / "out" / "new" / "art"   # two parent folders that write_artifact has to make
  old: dict[str, bytes] = {}
  if existing:
    out.mkdir(parents=True)
    for name in ("manifest.json", "metadata.json", "driving_policy.pkl", "driving_warp.pkl"):
      (out / name).write_bytes(f"old {name}".encode())
      old[name] = (out / name).read_bytes()
  before = _files(tmp_path)
  # 256 KiB: the 1 MiB policy pickle is the write that fails, after the temp dir and its first bytes exist
  p = subprocess.run([sys.executable, "-c", WRITE.format(repo=str(REPO), out=str(out))], capture_output=True, text=True, timeout=60,
                     preexec_fn=_limited(256 * 1024))
  assert p.returncode == 2, p.stdout + p.stderr
  assert "USERERROR out of disk space writing the artifact (File too large" in p.stdout, p.stdout + p.stderr
  assert f"nothing was written to {out}" in p.stdout and "Traceback" not in p.stderr
  assert _files(tmp_path) == before   # no .art.tmp-*, no .art.old-*, and without an old artifact no out/ or out/new/ either
  assert {n: (out / n).read_bytes() for n in old} == old


def test_write_artifact_without_a_limit_writes_it(tmp_path):
  """The same child without the limit: the artifact is written (the failure above is the limit's, not the script's)."""
  out = tmp_path / "out" / "art"
  p = subprocess.run([sys.executable, "-c", WRITE.format(repo=str(REPO), out=str(out))], capture_output=True, text=True, timeout=60)
  assert p.returncode == 0 and "WROTE" in p.stdout, p.stdout + p.stderr
  assert sorted(os.listdir(out)) == ["driving_policy.pkl", "driving_warp.pkl", "manifest.json", "metadata.json"]
  assert os.listdir(out.parent) == ["art"]


@pytest.mark.slow
def test_compile_cli_disk_full_is_one_clear_line_and_leaves_nothing(tmp_path, tiny_models):
  """`modeld-msm compile` of the tiny CPU artifact with 1 MiB of disk: the compile runs (it needs no disk but the artifact's
  ~6 MB of pickles), the artifact write fails, and the CLI says so in one line, exits 2, and leaves nothing: not in the output
  folder's parent, not in TMPDIR (the build's temp model copies). tinygrad's kernel cache is off (CACHELEVEL=0) so the
  failing write is the artifact's, whatever this machine's cache holds."""
  tmpdir = tmp_path / "tmp"
  tmpdir.mkdir()
  out = tmp_path / "out" / "art"
  env = {**os.environ, "CACHELEVEL": "0", "TMPDIR": str(tmpdir), "PYTHONDONTWRITEBYTECODE": "1"}
  p = subprocess.run([sys.executable, "-m", "cli.main", "compile", "--vision", str(tiny_models / "driving_vision.onnx"),
                      "--policy", str(tiny_models / "driving_policy.onnx"), "--camera", "1928x1208", "--device", "CPU", "-o", str(out)],
                     capture_output=True, text=True, timeout=600, cwd=REPO, env=env, preexec_fn=_limited(1 << 20))
  err = [ln for ln in p.stderr.splitlines() if ln.startswith("modeld-msm compile: error:")]
  assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
  assert len(err) == 1 and "out of disk space" in err[0] and "File too large" in err[0], p.stderr[-3000:]
  assert f"nothing was written to {out}" in err[0]
  assert "Traceback" not in p.stderr
  # no out/, no .art.tmp-*, and the build's temp dirs were removed too; tmp/.ses is onnxruntime's session id (every run writes it)
  assert [f for f in _files(tmp_path) if f != "tmp/.ses"] == ["tmp"]
