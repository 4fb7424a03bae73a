"""Every command against a catalogue of bad input, as a new user would type it: what comes back, and what is left on disk.

  python testing/bad_input_sweep.py [--quick] [--only WORD] [--keep DIR]

Each case runs `modeld-msm ...` in a subprocess with a time limit and is classified:
  clear      a non-zero exit with a short message and no traceback (what bad input must give)
  ok         exit 0 where the input was fine (the catalogue's control cases)
  traceback  a Python traceback on stderr
  hang       no exit within the time limit
  silent     exit 0 on input that is wrong (a silent success or a wrong result)
  lost       a file that was there before the run changed or disappeared (data lost)
  half       something was left half-written: a temp file/folder of ours, or the output appeared although the run failed
Read-only outputs are a read-only bind mount in a private mount namespace (`unshare -rm`), a full disk is RLIMIT_FSIZE
(writes past it fail with EFBIG as a full disk fails with ENOSPC), an interrupted write is SIGINT after a while.
`--quick` keeps to the cases that need no compiled artifact (tests/test_bad_input_sweep.py runs those in CI); the whole
catalogue compiles a tiny CPU artifact and a CPU bundle first (about a minute). Exit status 1 if any case is not clear/ok.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOOD = ("clear", "ok")
TEMP_MARKS = (".tmp-", ".tmp", ".old-", ".part")


@dataclasses.dataclass
class Case:
  name: str
  argv: Callable[[Workspace], list[str]]          # the command line after `modeld-msm`
  expect: str = "error"                           # "error": bad input; "ok": a control that must succeed; "either": input a tool
                                                  # cannot tell from good (a flipped weight byte), so a clean run or a clear error;
                                                  # "fail verdict": a check that must answer FAIL (exit 1, "verdict: FAIL")
  outputs: Callable[[Workspace], list[Path]] = lambda ws: []   # paths the command may create: must not exist after a failure
  setup: Callable[[Workspace], None] = lambda ws: None
  readonly: Callable[[Workspace], Path] | None = None   # a folder made read-only for the run
  fsize: int | None = None                        # RLIMIT_FSIZE bytes: a full disk
  interrupt_after: float | None = None            # SIGINT after this many seconds: an interrupted write
  quick: bool = True                              # needs no compiled artifact
  timeout: float = 120
  watch: Callable[[Workspace], list[Path]] = lambda ws: [ws.root]   # trees whose existing files must survive

  @property
  def command(self) -> str:
    return self.name.split()[0]


class Workspace:
  """Good inputs made once, and a scratch folder per case."""

  def __init__(self, root: Path, quick: bool):
    self.root = root
    self.models = root / "models"
    self.seg = root / "seg"
    self.keys = root / "keys"
    self.art = root / "artifact"
    self.bundle = root / "bundle"
    self.replay_out = root / "replay-out"
    self.op = root / "openpilot"
    self.scratch = root / "scratch"
    self.quick = quick

  def prepare(self) -> None:
    self.scratch.mkdir(parents=True, exist_ok=True)
    _ok("models", "--size", "tiny", "-o", self.models)
    _ok("synth", "-o", self.seg, "--seconds", "2", "--seed", "1", "--quiet")
    _ok("keygen", "-o", self.keys)
    _make_openpilot(self.op)
    if not self.quick:
      _ok("compile", "--vision", self.vision, "--policy", self.policy, "--device", "CPU", "-o", self.art)
      _ok("release", "--vision", self.vision, "--policy", self.policy, "--device", "CPU", "--camera", "1928x1208",
          "--smoke-frames", "4", "-o", self.bundle)
      _ok("replay", self.seg, "--artifact", self.art, "-o", self.replay_out, "--quiet")

  @property
  def vision(self) -> Path:
    return self.models / "driving_vision.onnx"

  @property
  def policy(self) -> Path:
    return self.models / "driving_policy.onnx"

  def s(self, name: str) -> Path:
    return self.scratch / name


def _cli(*args) -> list[str]:
  return [sys.executable, "-m", "cli.main", *map(str, args)]


def _ok(*args) -> None:
  r = subprocess.run(_cli(*args), capture_output=True, text=True, cwd=REPO, timeout=900)
  if r.returncode != 0:
    raise SystemExit(f"preparing the workspace: modeld-msm {' '.join(map(str, args))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _make_openpilot(root: Path) -> None:
  """The shape `install` edits: system/manager/process_config.py with a procs list, and an `openpilot -> .` link."""
  d = root / "system" / "manager"
  d.mkdir(parents=True, exist_ok=True)
  (d / "process_config.py").write_text(
    "from openpilot.system.manager.process import NativeProcess, PythonProcess\n\n"
    "def only_onroad(started, params, CP):\n  return started\n\n"
    "procs = [\n"
    '  PythonProcess("modeld", "selfdrive.modeld.modeld", only_onroad),\n'
    "]\n")
  (d / "process.py").write_text("class PythonProcess:\n  def __init__(self, name, module, should_run, *a, **kw):\n"
                                "    self.name, self.module, self.should_run = name, module, should_run\n"
                                "class NativeProcess(PythonProcess):\n  pass\n")
  (root / "selfdrive" / "modeld").mkdir(parents=True, exist_ok=True)
  if not (root / "openpilot").exists():
    (root / "openpilot").symlink_to(".")


# ---- helpers for the catalogue ----

def _write(path: Path, data: bytes | str) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data.encode() if isinstance(data, str) else data)
  return path


def _flip(src: Path, dst: Path, at: float = 0.5, n: int = 1) -> Path:
  b = bytearray(src.read_bytes())
  i = int(len(b) * at)
  for k in range(n):
    b[i + k] ^= 0xFF
  return _write(dst, bytes(b))


def _truncate(src: Path, dst: Path, frac: float = 0.5) -> Path:
  b = src.read_bytes()
  return _write(dst, b[:int(len(b) * frac)])


def _copy_tree(src: Path, dst: Path) -> Path:
  if dst.exists():
    shutil.rmtree(dst)
  shutil.copytree(src, dst, symlinks=True)
  return dst


def catalogue() -> list[Case]:
  c: list[Case] = []
  add = c.append
  # models
  add(Case("models good", lambda ws: ["models", "--size", "tiny", "-o", ws.s("m-good")], expect="ok"))
  add(Case("models bad size", lambda ws: ["models", "--size", "huge", "-o", ws.s("m1")], outputs=lambda ws: [ws.s("m1")]))
  add(Case("models -o file", lambda ws: ["models", "--size", "tiny", "-o", _write(ws.s("m-file"), "x")]))
  add(Case("models -o read-only", lambda ws: ["models", "--size", "tiny", "-o", ws.s("ro-m") / "out"],
           setup=lambda ws: ws.s("ro-m").mkdir(exist_ok=True), readonly=lambda ws: ws.s("ro-m")))
  add(Case("models disk full", lambda ws: ["models", "--size", "tiny", "-o", ws.s("m-full")], fsize=64 * 1024,
           outputs=lambda ws: [ws.s("m-full") / "driving_vision.onnx"]))
  add(Case("models over the user's model file", lambda ws: ["models", "--contract", "dmonitoring", "-o",
                                                             _write(ws.s("m-user") / "dmonitoring_model.onnx", "the user's model").parent]))
  add(Case("train-dm over the user's model file", lambda ws: ["train-dm", "--steps", "1", "-o",
                                                              _write(ws.s("t-user") / "dmonitoring_model.onnx", "the user's model").parent]))
  add(Case("compile --model with --dmonitoring", lambda ws: ["compile", "--model", ws.vision, "--dmonitoring", ws.vision, "-o", ws.s("c-md")],
           outputs=lambda ws: [ws.s("c-md")]))
  add(Case("models seed negative", lambda ws: ["models", "--size", "tiny", "--seed", "-3", "-o", ws.s("m2")], outputs=lambda ws: [ws.s("m2")]))
  # compile: paths, kinds, bytes, strings
  def comp(ws, vision=None, policy=None, *extra, out=None):
    return ["compile", "--vision", vision or ws.vision, "--policy", policy or ws.policy, *extra, "-o", out or ws.s("c-out")]
  def out_c(ws):
    return [ws.s("c-out")]
  add(Case("compile missing vision", lambda ws: comp(ws, ws.s("nope.onnx")), outputs=out_c))
  add(Case("compile vision is a folder", lambda ws: comp(ws, ws.models), outputs=out_c))
  add(Case("compile empty vision", lambda ws: comp(ws, _write(ws.s("empty.onnx"), b"")), outputs=out_c))
  add(Case("compile truncated vision", lambda ws: comp(ws, _truncate(ws.vision, ws.s("trunc.onnx"))), outputs=out_c))
  add(Case("compile bit-flipped vision", lambda ws: comp(ws, _flip(ws.vision, ws.s("flip.onnx"), 0.3, 8)), expect="either", timeout=240))
  add(Case("compile flipped model header", lambda ws: comp(ws, _flip(ws.vision, ws.s("flip0.onnx"), 0.0, 2)), outputs=out_c, timeout=240))
  add(Case("compile text as vision", lambda ws: comp(ws, _write(ws.s("text.onnx"), "hello world\n")), outputs=out_c))
  add(Case("compile vision and policy swapped", lambda ws: comp(ws, ws.policy, ws.vision), outputs=out_c))
  add(Case("compile bad camera", lambda ws: comp(ws, None, None, "--camera", "1920x1080"), outputs=out_c))
  add(Case("compile camera not a size", lambda ws: comp(ws, None, None, "--camera", "abc"), outputs=out_c))
  add(Case("compile bad device", lambda ws: comp(ws, None, None, "--device", "TPU"), outputs=out_c))
  add(Case("compile CUDA without a GPU", lambda ws: comp(ws, None, None, "--device", "CUDA"), outputs=out_c))
  add(Case("compile NV without a GPU", lambda ws: comp(ws, None, None, "--device", "NV"), outputs=out_c))
  add(Case("compile AMD without a GPU", lambda ws: comp(ws, None, None, "--device", "AMD"), outputs=out_c))
  add(Case("compile bad precision", lambda ws: comp(ws, None, None, "--precision", "int8"), outputs=out_c))
  add(Case("compile -o holds the inputs", lambda ws: comp(ws, (d := _copy_tree(ws.models, ws.s("victim"))) / "driving_vision.onnx",
                                                          d / "driving_policy.onnx", out=d)))
  add(Case("compile -o a stranger's folder", lambda ws: comp(ws, out=_write(ws.s("stranger") / "notes.txt", "keep").parent)))
  add(Case("compile -o file", lambda ws: comp(ws, out=_write(ws.s("c-file"), "x"))))
  add(Case("compile -o read-only", lambda ws: comp(ws, out=ws.s("ro-c") / "out"), setup=lambda ws: ws.s("ro-c").mkdir(exist_ok=True),
           readonly=lambda ws: ws.s("ro-c")))
  # verify / keygen / sign (quick ones need no artifact)
  add(Case("verify missing", lambda ws: ["verify", ws.s("nothing")]))
  add(Case("verify a file", lambda ws: ["verify", _write(ws.s("v-file"), "x")]))
  add(Case("verify empty folder", lambda ws: ["verify", (ws.s("v-empty").mkdir(exist_ok=True), ws.s("v-empty"))[1]]))
  add(Case("verify manifest is a folder", lambda ws: ["verify", (ws.s("v-mdir") / "manifest.json").mkdir(parents=True, exist_ok=True)
                                                      or ws.s("v-mdir")]))
  add(Case("verify manifest garbage", lambda ws: ["verify", _write(ws.s("v-garb") / "manifest.json", b"\x00\xff{").parent]))
  add(Case("verify bad device", lambda ws: ["verify", ws.s("nothing"), "--device", "FOO"]))
  add(Case("keygen good", lambda ws: ["keygen", "-o", ws.s("k-good")], expect="ok"))
  add(Case("keygen -o file", lambda ws: ["keygen", "-o", _write(ws.s("k-file"), "x")]))
  add(Case("keygen -o read-only", lambda ws: ["keygen", "-o", ws.s("ro-k") / "keys"], setup=lambda ws: ws.s("ro-k").mkdir(exist_ok=True),
           readonly=lambda ws: ws.s("ro-k")))
  add(Case("keygen over existing keys", lambda ws: ["keygen", "-o", _copy_tree(ws.keys, ws.s("k-again"))]))
  add(Case("sign missing path", lambda ws: ["sign", ws.s("nothing"), "--key", _key(ws)]))
  add(Case("sign key is a folder", lambda ws: ["sign", ws.s("nothing"), "--key", ws.keys]))
  add(Case("sign key garbage", lambda ws: ["sign", ws.s("nothing"), "--key", _write(ws.s("garbage.key"), "not a key")]))
  # synth
  add(Case("synth seconds nan", lambda ws: ["synth", "-o", ws.s("sy1"), "--seconds", "nan"], outputs=lambda ws: [ws.s("sy1")]))
  add(Case("synth seconds negative", lambda ws: ["synth", "-o", ws.s("sy2"), "--seconds", "-1"], outputs=lambda ws: [ws.s("sy2")]))
  add(Case("synth seconds inf", lambda ws: ["synth", "-o", ws.s("sy3"), "--seconds", "inf"], outputs=lambda ws: [ws.s("sy3")]))
  add(Case("synth segments 0", lambda ws: ["synth", "-o", ws.s("sy4"), "--segments", "0"], outputs=lambda ws: [ws.s("sy4")]))
  add(Case("synth bad camera", lambda ws: ["synth", "-o", ws.s("sy5"), "--camera", "640x480"], outputs=lambda ws: [ws.s("sy5")]))
  add(Case("synth -o non-empty", lambda ws: ["synth", "-o", _write(ws.s("sy6") / "mine.txt", "keep").parent, "--seconds", "1"]))
  add(Case("synth -o file", lambda ws: ["synth", "-o", _write(ws.s("sy7"), "x"), "--seconds", "1"]))
  add(Case("synth -o read-only", lambda ws: ["synth", "-o", ws.s("ro-sy") / "seg", "--seconds", "1", "--quiet"],
           setup=lambda ws: ws.s("ro-sy").mkdir(exist_ok=True), readonly=lambda ws: ws.s("ro-sy")))
  add(Case("synth disk full", lambda ws: ["synth", "-o", ws.s("sy-full"), "--seconds", "2", "--quiet"], fsize=100 * 1024,
           outputs=lambda ws: [ws.s("sy-full")]))
  # replay of broken segments (a replay without --artifact compiles the tiny stand-in once, cached)
  def rep(seg, out):
    return ["replay", seg, "-o", out, "--quiet"]
  add(Case("replay missing segment", lambda ws: rep(ws.s("noseg"), ws.s("r1")), outputs=lambda ws: [ws.s("r1")]))
  add(Case("replay segment is a file", lambda ws: rep(_write(ws.s("segfile"), "x"), ws.s("r2")), outputs=lambda ws: [ws.s("r2")]))
  add(Case("replay empty segment folder", lambda ws: rep((ws.s("segempty").mkdir(exist_ok=True), ws.s("segempty"))[1], ws.s("r3")),
           outputs=lambda ws: [ws.s("r3")]))
  add(Case("replay no rlog", lambda ws: rep(_seg_without(ws, "segnorlog", "rlog"), ws.s("r4")), outputs=lambda ws: [ws.s("r4")]))
  add(Case("replay no fcamera", lambda ws: rep(_seg_without(ws, "segnofcam", "fcamera"), ws.s("r5")), outputs=lambda ws: [ws.s("r5")]))
  add(Case("replay truncated rlog", lambda ws: rep(_seg_mutated(ws, "segtrunc", "rlog", _truncate), ws.s("r6")), timeout=300,
           outputs=lambda ws: [ws.s("r6")]))
  add(Case("replay empty rlog", lambda ws: rep(_seg_mutated(ws, "segemptylog", "rlog", lambda s, d: _write(d, b"")), ws.s("r7")),
           outputs=lambda ws: [ws.s("r7")]))
  add(Case("replay -o read-only", lambda ws: rep(ws.seg, ws.s("ro-r") / "out"), setup=lambda ws: ws.s("ro-r").mkdir(exist_ok=True),
           readonly=lambda ws: ws.s("ro-r"), timeout=300))
  add(Case("replay bad jobs", lambda ws: ["replay", ws.seg, "-o", ws.s("r8"), "-j", "0"], outputs=lambda ws: [ws.s("r8")]))
  # regress
  add(Case("regress missing", lambda ws: ["regress", ws.s("a.zst"), ws.s("b.zst")]))
  add(Case("regress garbage logs", lambda ws: ["regress", _write(ws.s("ga.zst"), b"\x28\xb5\x2f\xfdgarbage"), _write(ws.s("gb.zst"), b"junk")]))
  # install / uninstall
  add(Case("install missing openpilot", lambda ws: ["install", ws.s("no-op"), "--bundle", ws.s("no-bundle")]))
  add(Case("install not an openpilot tree", lambda ws: ["install", (ws.s("not-op").mkdir(exist_ok=True), ws.s("not-op"))[1],
                                                        "--bundle", ws.s("no-bundle")]))
  add(Case("install bundle is a file", lambda ws: ["install", _copy_tree(ws.op, ws.s("op1")), "--bundle", _write(ws.s("bfile"), "x")]))
  add(Case("install pubkey is a folder", lambda ws: ["install", _copy_tree(ws.op, ws.s("op2")), "--bundle", ws.s("no-bundle"),
                                                     "--pubkey", ws.keys]))
  # nothing to undo is not an error (as `apt remove` / `pip uninstall` of what is absent): a control, tree left untouched
  add(Case("uninstall never installed", lambda ws: ["uninstall", _copy_tree(ws.op, ws.s("op3"))], expect="ok"))
  add(Case("uninstall missing", lambda ws: ["uninstall", ws.s("no-op")]))
  # smoke / doctor / demo / train / serve
  add(Case("smoke missing bundle", lambda ws: ["smoke", "--bundle", ws.s("no-bundle")]))
  add(Case("smoke bad camera", lambda ws: ["smoke", "--bundle", ws.s("no-bundle"), "--camera", "abc"]))
  add(Case("smoke frames 0", lambda ws: ["smoke", "--bundle", ws.s("no-bundle"), "--frames", "0"]))
  add(Case("doctor rounds negative", lambda ws: ["doctor", "--rounds", "-5"]))
  add(Case("demo seconds nan", lambda ws: ["demo", "--seconds", "nan", "--out", ws.s("d1")], outputs=lambda ws: [ws.s("d1")]))
  add(Case("demo bad camera", lambda ws: ["demo", "--camera", "12x12", "--out", ws.s("d2")], outputs=lambda ws: [ws.s("d2")]))
  add(Case("demo --out file", lambda ws: ["demo", "--seconds", "1", "--out", _write(ws.s("d-file"), "x")]))
  add(Case("train lr nan", lambda ws: ["train", "-o", ws.s("t1"), "--lr", "nan"], outputs=lambda ws: [ws.s("t1")]))
  add(Case("train frames 1", lambda ws: ["train", "-o", ws.s("t2"), "--frames", "1"], outputs=lambda ws: [ws.s("t2")]))
  add(Case("serve missing artifact", lambda ws: ["serve", "--artifact", ws.s("no-art")]))
  add(Case("unknown command", lambda ws: ["frobnicate"]))
  # ---- the cases that need the compiled artifact / bundle / replay output ----
  slow = []
  s = slow.append
  s(Case("compile over our artifact", lambda ws: comp(ws, out=_copy_tree(ws.art, ws.s("ours"))), expect="ok", timeout=300))
  s(Case("verify good", lambda ws: ["verify", ws.art], expect="ok"))
  s(Case("verify wrong camera", lambda ws: ["verify", ws.art, "--camera", "1344x760"]))
  s(Case("verify wrong device", lambda ws: ["verify", ws.art, "--device", "QCOM"]))
  s(Case("verify pubkey is a folder", lambda ws: ["verify", ws.art, "--pubkey", ws.keys]))
  s(Case("verify pubkey garbage", lambda ws: ["verify", ws.art, "--pubkey", _write(ws.s("garbage.pub"), "nope")]))
  s(Case("verify unsigned with a key", lambda ws: ["verify", ws.art, "--pubkey", _pub(ws)]))
  s(Case("verify tampered pickle", lambda ws: ["verify", _tamper(ws, "art-tamper", "driving_policy.pkl")]))
  s(Case("verify tampered metadata", lambda ws: ["verify", _tamper(ws, "art-tamper-meta", "metadata.json")]))
  s(Case("verify missing pickle", lambda ws: ["verify", _remove(ws, "art-nopkl", "driving_policy.pkl")]))
  s(Case("sign read-only artifact", lambda ws: ["sign", ws.s("ro-sign") / "art", "--key", _key(ws)],
         setup=lambda ws: _copy_tree(ws.art, ws.s("ro-sign") / "art") and None, readonly=lambda ws: ws.s("ro-sign")))
  s(Case("release -o holds the inputs", lambda ws: ["release", "--vision", (d := _copy_tree(ws.models, ws.s("rvictim"))) / "driving_vision.onnx",
                                                   "--policy", d / "driving_policy.onnx", "--device", "CPU", "-o", d]))
  s(Case("release -o read-only", lambda ws: ["release", "--vision", ws.vision, "--policy", ws.policy, "--device", "CPU", "--camera", "1928x1208",
                                            "--smoke-frames", "2", "-o", ws.s("ro-rel") / "b"], setup=lambda ws: ws.s("ro-rel").mkdir(exist_ok=True),
         readonly=lambda ws: ws.s("ro-rel"), timeout=300))
  s(Case("release interrupted", lambda ws: ["release", "--vision", ws.vision, "--policy", ws.policy, "--device", "CPU", "--camera", "1928x1208",
                                           "--smoke-frames", "2", "-o", ws.s("rel-int")], interrupt_after=8, outputs=lambda ws: [ws.s("rel-int")]))
  s(Case("compile interrupted", lambda ws: comp(ws, out=ws.s("c-int")), interrupt_after=8, outputs=lambda ws: [ws.s("c-int")]))
  s(Case("smoke good", lambda ws: ["smoke", "--bundle", ws.bundle], expect="ok", timeout=300))
  s(Case("smoke camera not in bundle", lambda ws: ["smoke", "--bundle", ws.bundle, "--camera", "1344x760"]))
  s(Case("install good dry run", lambda ws: ["install", _copy_tree(ws.op, ws.s("op-dry")), "--bundle", ws.bundle, "--dry-run", "--allow-cpu"],
         expect="ok"))
  s(Case("install CPU bundle without --allow-cpu", lambda ws: ["install", _copy_tree(ws.op, ws.s("op-cpu")), "--bundle", ws.bundle]))
  s(Case("install read-only openpilot", lambda ws: ["install", ws.s("ro-op") / "op", "--bundle", ws.bundle, "--allow-cpu"],
         setup=lambda ws: _copy_tree(ws.op, ws.s("ro-op") / "op") and None, readonly=lambda ws: ws.s("ro-op")))
  s(Case("regress good", lambda ws: ["regress", _replayed(ws), _replayed(ws)], expect="ok"))
  s(Case("regress --report file", lambda ws: ["regress", _replayed(ws), _replayed(ws), "--report", _write(ws.s("rep-file"), "x")]))
  s(Case("regress --report read-only", lambda ws: ["regress", _replayed(ws), _replayed(ws), "--report", ws.s("ro-rep") / "r"],
         setup=lambda ws: ws.s("ro-rep").mkdir(exist_ok=True), readonly=lambda ws: ws.s("ro-rep")))
  s(Case("regress truncated log", lambda ws: ["regress", _truncate(_replayed(ws), ws.s("trunc.zst"), 0.3), _replayed(ws)]))
  s(Case("replay good", lambda ws: ["replay", ws.seg, "--artifact", ws.art, "-o", ws.s("r-good"), "--quiet"], expect="ok", timeout=300))
  s(Case("replay wrong-camera artifact", lambda ws: ["replay", _synth_1344(ws), "--artifact", ws.art, "-o", ws.s("r-cam"), "--quiet"],
         outputs=lambda ws: [ws.s("r-cam")], timeout=300))
  s(Case("replay disk full", lambda ws: ["replay", ws.seg, "--artifact", ws.art, "-o", ws.s("r-full"), "--quiet"], fsize=20 * 1024,
         timeout=300))
  # issue 40: the release and install path as an attacker would use it
  s(Case("install bundle with a link to a host file", lambda ws: ["install", _copy_tree(ws.op, ws.s("op-link")), "--bundle",
                                                                  _linked_bundle(ws), "--allow-cpu"]))
  s(Case("install bundle.json entry not a table", lambda ws: ["install", _copy_tree(ws.op, ws.s("op-shape")), "--bundle",
                                                              _bundle_edited(ws, "b-shape", lambda i: i["artifacts"].update({"1928x1208": "x"})),
                                                              "--allow-cpu"]))
  s(Case("verify smoke name leaves the bundle", lambda ws: ["verify", _bundle_edited(
    ws, "b-escape", lambda i: i["artifacts"]["1928x1208"]["smoke"]["files"].update({"../../../../etc/passwd": "0" * 64}))]))
  s(Case("smoke forged tolerance", lambda ws: ["smoke", "--bundle", _forged_smoke(ws), "--skip-doctor"], expect="fail verdict", timeout=300))
  s(Case("compile -o our artifact with user notes", lambda ws: comp(ws, out=_with_notes(_copy_tree(ws.art, ws.s("ours-notes"))))))
  for case in slow:
    case.quick = False
  return c + slow


def _bundle_edited(ws: Workspace, name: str, edit) -> Path:
  import json
  d = _copy_tree(ws.bundle, ws.s(name))
  idx = json.loads((d / "bundle.json").read_text())
  edit(idx)
  (d / "bundle.json").write_text(json.dumps(idx))
  return d


def _linked_bundle(ws: Workspace) -> Path:
  d = _copy_tree(ws.bundle, ws.s("b-link"))
  meta = d / "1928x1208" / "metadata.json"
  real = _write(ws.s("elsewhere") / "metadata.json", meta.read_bytes())
  meta.unlink()
  meta.symlink_to(real)
  return d


def _forged_smoke(ws: Workspace) -> Path:
  """Expected outputs made wrong, a tolerance of 1e9 in smoke.json, and bundle.json's hashes following both."""
  import io
  import json

  import numpy as np
  d = _copy_tree(ws.bundle, ws.s("b-forged"))
  sd = d / "smoke" / "1928x1208"
  with np.load(sd / "expected.npz") as z:
    raw, frame = z["raw"] + 5.0, z["frame"]
  b = io.BytesIO()
  np.savez_compressed(b, raw=raw, frame=frame)
  (sd / "expected.npz").write_bytes(b.getvalue())
  meta = json.loads((sd / "smoke.json").read_text())
  meta["tolerance"] = {"rtol": 1e9, "atol": 1e9}
  (sd / "smoke.json").write_text(json.dumps(meta))
  idx = json.loads((d / "bundle.json").read_text())
  idx["artifacts"]["1928x1208"]["smoke"]["files"].update({n: hashlib.sha256((sd / n).read_bytes()).hexdigest()
                                                          for n in ("expected.npz", "smoke.json")})
  (d / "bundle.json").write_text(json.dumps(idx))
  return d


def _with_notes(d: Path) -> Path:
  _write(d / "NOTES.txt", "the user's notes")
  return d


def _key(ws: Workspace) -> Path:
  return next(p for p in ws.keys.iterdir() if p.suffix == ".key")


def _pub(ws: Workspace) -> Path:
  return next(p for p in ws.keys.iterdir() if p.suffix == ".pub")


def _replayed(ws: Workspace) -> Path:
  return next(p for p in sorted(ws.replay_out.rglob("*.zst")) if not p.name.startswith("."))


def _seg_without(ws: Workspace, name: str, stem: str) -> Path:
  d = _copy_tree(ws.seg, ws.s(name))
  for p in list(d.iterdir()):
    if p.name.startswith(stem):
      p.unlink()
  return d


def _seg_mutated(ws: Workspace, name: str, stem: str, how) -> Path:
  d = _copy_tree(ws.seg, ws.s(name))
  for p in list(d.iterdir()):
    if p.name.startswith(stem):
      how(p, p)
  return d


def _tamper(ws: Workspace, name: str, file: str) -> Path:
  d = _copy_tree(ws.art, ws.s(name))
  _flip(d / file, d / file, 0.5, 4)
  return d


def _remove(ws: Workspace, name: str, file: str) -> Path:
  d = _copy_tree(ws.art, ws.s(name))
  (d / file).unlink()
  return d


def _synth_1344(ws: Workspace) -> Path:
  d = ws.s("seg1344")
  if not d.exists():
    _ok("synth", "-o", d, "--seconds", "1", "--seed", "2", "--camera", "1344x760", "--quiet")
  return d


# ---- running and classifying ----

def _snapshot(roots: list[Path]) -> dict[str, str]:
  out = {}
  for root in roots:
    if root.is_file():
      out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
      continue
    for p in root.rglob("*"):
      try:
        if p.is_file() and not p.is_symlink():
          out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
      except OSError:
        pass
  return out


def _temp_leftovers(root: Path, before: set[str]) -> list[str]:
  return sorted(str(p) for p in root.rglob(".*") if str(p) not in before and any(m in p.name for m in TEMP_MARKS))


def _can_unshare() -> bool:
  return shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@dataclasses.dataclass
class Result:
  case: Case
  verdict: str
  rc: int | None
  seconds: float
  detail: str


def run_case(case: Case, ws: Workspace) -> Result:
  """An interrupt case whose command finished before its SIGINT (a warm cache, a fast box) tested nothing: it runs again,
  interrupted at half the time the finished run took, up to three times."""
  for _ in range(3):
    outputs = [p for p in case.outputs(ws) if not p.exists()]
    r = _run_once(case, ws)
    if case.interrupt_after is None or r.detail != FINISHED_FIRST:
      return r
    for o in outputs:
      if o.is_dir():
        shutil.rmtree(o, ignore_errors=True)
      else:
        o.unlink(missing_ok=True)
    case = dataclasses.replace(case, interrupt_after=max(0.5, r.seconds / 2))
  return dataclasses.replace(r, verdict="ok", detail=f"finished in {r.seconds:.1f} s, before any interrupt could land")


FINISHED_FIRST = "finished before the interrupt"


def _run_once(case: Case, ws: Workspace) -> Result:
  case.setup(ws)
  argv = [str(a) for a in case.argv(ws)]
  watched = case.watch(ws)
  before = _snapshot(watched)
  dots_before = {str(p) for p in ws.root.rglob(".*")}
  outputs = [p for p in case.outputs(ws) if not p.exists()]
  cmd = _cli(*argv)
  preexec = None
  if case.readonly is not None:
    ro = str(case.readonly(ws))
    cmd = ["unshare", "-rm", "sh", "-c", 'mount -o bind,ro "$0" "$0" && exec "$@"', ro, *cmd]
  if case.fsize is not None:
    limit = case.fsize
    def preexec() -> None:
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      import resource
      resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
                       start_new_session=True)
  interrupted = False
  try:
    out, err = p.communicate(timeout=case.interrupt_after if case.interrupt_after is not None else case.timeout)
  except subprocess.TimeoutExpired:
    interrupted = True
    if case.interrupt_after is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
      return Result(case, "hang", None, time.perf_counter() - t0, f"no exit in {case.timeout:.0f} s")
    os.killpg(p.pid, signal.SIGINT)
    try:
      out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
      return Result(case, "hang", None, time.perf_counter() - t0, "no exit within 60 s of SIGINT")
  dt = time.perf_counter() - t0
  rc = p.returncode
  err_tail = err.strip().splitlines()[-1] if err.strip() else ""
  after = _snapshot(watched)
  lost = sorted(k for k, v in before.items() if after.get(k) != v and not _expected_change(case, ws, k))
  if "Traceback (most recent call last)" in err:
    return Result(case, "traceback", rc, dt, err_tail[:160])
  if lost:
    return Result(case, "lost", rc, dt, f"{len(lost)} file(s) changed or gone, e.g. {lost[0]}")
  leftovers = _temp_leftovers(ws.root, dots_before)
  made = [str(o) for o in outputs if o.exists()] if rc != 0 else []
  if leftovers or made:
    return Result(case, "half", rc, dt, f"left behind: {(leftovers + made)[0]}")
  if case.expect == "ok":
    return Result(case, "ok" if rc == 0 else "silent", rc, dt, "" if rc == 0 else f"a control case failed: {err_tail[:160]}")
  if case.expect == "fail verdict":   # a check that must say FAIL (exit 1, its verdict on stdout) rather than refuse the input
    verdict = next((ln for ln in out.splitlines() if ln.startswith("verdict:")), "")
    return Result(case, "clear" if rc == 1 and "FAIL" in verdict else "silent", rc, dt, verdict[:160] or f"exit {rc}, no verdict")
  if rc == 0 and case.interrupt_after is not None and not interrupted:
    return Result(case, "ok", rc, dt, FINISHED_FIRST)
  if rc == 0:
    return Result(case, "ok", rc, dt, "") if case.expect == "either" else Result(case, "silent", rc, dt, "exit 0 on bad input")
  if case.interrupt_after is not None:
    return Result(case, "clear", rc, dt, f"interrupted: exit {rc}")
  if not err_tail or len(err.strip().splitlines()) > 6:
    return Result(case, "traceback" if not err_tail else "clear", rc, dt, f"{len(err.splitlines())} lines on stderr: {err_tail[:120]}")
  return Result(case, "clear", rc, dt, err_tail[:160])


def _expected_change(case: Case, ws: Workspace, path: str) -> bool:
  """Files a control case is meant to rewrite (its own outputs, replaced whole)."""
  if case.expect != "ok":
    return False
  argv = [str(a) for a in case.argv(ws)]
  return any(path.startswith(a + os.sep) or path == a for a in argv if a.startswith(str(ws.scratch)))


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="only the cases that need no compiled artifact")
  ap.add_argument("--only", help="only cases whose name contains one of these (comma-separated)")
  ap.add_argument("--keep", type=Path, help="keep the workspace in this folder (default: a temp folder, removed)")
  a = ap.parse_args(argv)
  cases = [c for c in catalogue() if (c.quick or not a.quick) and (a.only is None or any(w in c.name for w in a.only.split(",")))]
  unshare = _can_unshare()
  if not unshare:
    print("note: `unshare -rm` is not available here: the read-only cases are skipped", file=sys.stderr)
    cases = [c for c in cases if c.readonly is None]
  root = a.keep or Path(tempfile.mkdtemp(prefix="bad-input-sweep-"))
  ws = Workspace(root, quick=a.quick)
  t0 = time.perf_counter()
  print(f"preparing the workspace in {root} ({'quick' if a.quick else 'full'}: models, a segment, keys"
        + ("" if a.quick else ", an artifact, a bundle, a replay") + ")", file=sys.stderr, flush=True)
  ws.prepare()
  results: list[Result] = []
  try:
    for i, case in enumerate(cases, 1):
      r = run_case(case, ws)
      results.append(r)
      eta = (time.perf_counter() - t0) / i * (len(cases) - i)
      print(f"[{i:3d}/{len(cases)} {time.perf_counter() - t0:6.0f} s, ETA {eta:4.0f} s] {r.verdict:9s} {case.name}  {r.detail}",
            file=sys.stderr, flush=True)
  finally:
    if a.keep is None:
      shutil.rmtree(root, ignore_errors=True)
  kinds = ["clear", "ok", "traceback", "hang", "silent", "lost", "half"]
  by_cmd: dict[str, Counter] = {}
  for r in results:
    by_cmd.setdefault(r.case.command, Counter())[r.verdict] += 1
  print("\n| command | cases | " + " | ".join(kinds) + " |")
  print("| --- | --- | " + " | ".join("---" for _ in kinds) + " |")
  total: Counter = Counter()
  for cmd, cnt in by_cmd.items():
    total.update(cnt)
    print(f"| {cmd} | {sum(cnt.values())} | " + " | ".join(str(cnt[k]) for k in kinds) + " |")
  print(f"| **all** | {sum(total.values())} | " + " | ".join(f"**{total[k]}**" for k in kinds) + " |")
  bad = [r for r in results if r.verdict not in GOOD]
  for r in bad:
    print(f"  {r.verdict}: {r.case.name}: {r.detail}")
  print(f"\nsweep: {len(results) - len(bad)} of {len(results)} cases clear or ok, {len(bad)} not ({time.perf_counter() - t0:.0f} s)")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
