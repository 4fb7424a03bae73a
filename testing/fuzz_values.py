"""Message values fuzzer (issue 40): hostile values in every field modeld and dmonitoringmodeld read, published over our
msgq to the two real processes, which read camera frames from our VisionIPC server.

For each frame, each subscribed service gets either a good message, one field set to a hostile value (NaN, +-inf,
negative, zero, huge; rpyCalib also of the wrong length), or another service's Event on its socket (the wrong union
member). Contract: both processes keep publishing one output per frame; every output is finite or marked invalid
(Event.valid False); and once the bad publisher stops, the next outputs are valid and finite again (nothing sticky).

  .venv/bin/python bench/fuzz_values.py --frames 3000 --seed 1        (compiles tiny CPU artifacts into a temp folder)
"""
from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRAME_NS = 50_000_000
HOSTILE = (math.nan, math.inf, -math.inf, -1.0, -0.075, 0.0, 1e30, -1e30, 3.4e38)
# service -> the numeric fields the processes read from it (modeld_msm/core.py, dm_core.py; modeld_msm/inputs_check.py)
FIELDS: dict[str, tuple[str, ...]] = {
  "carState": ("vEgo", "steeringTorque"),
  "liveDelay": ("lateralDelay",),
  "liveCalibration": ("rpyCalib",),
  "extrinsicsCalibration": ("rpyCalib",),
  "roadCameraState": ("frameId",),
  "driverMonitoringState": ("isRHD",),
  "carControl": ("latActive",),
  "deviceState": ("deviceType",),
}
# the Event member each service's messages carry (extrinsicsCalibration is master's name for liveCalibration's member)
MEMBER = {"extrinsicsCalibration": "liveCalibration"}


@dataclass
class ValuesResult:
  frames: int = 0
  bad_sent: int = 0
  wrong_member_sent: int = 0
  outputs: dict[str, int] = field(default_factory=lambda: {"modelV2": 0, "driverStateV2": 0})
  invalid: dict[str, int] = field(default_factory=lambda: {"modelV2": 0, "driverStateV2": 0})
  violations: list[str] = field(default_factory=list)      # a valid output with a NaN/inf
  missing: dict[str, int] = field(default_factory=lambda: {"modelV2": 0, "driverStateV2": 0})   # frames without an output
  recovered: bool = False
  died: list[str] = field(default_factory=list)
  log_lines: dict[str, int] = field(default_factory=dict)   # lines each process logged (once per burst of a bad field)

  @property
  def ok(self) -> bool:
    return not self.violations and not self.died and self.recovered and all(v > 0 for v in self.outputs.values())


def _good(messaging, svc: str, n: int):
  member = MEMBER.get(svc, svc)
  e = messaging.new_message(member, valid=True)   # the Event's member; the socket it goes out on is svc's
  m = getattr(e, member)
  if member == "carState":
    m.vEgo, m.steeringTorque = 20.0, 0.0
  elif member == "liveDelay":
    m.lateralDelay = 0.25
  elif member == "liveCalibration":
    m.rpyCalib = [0.0, 0.01, -0.01]
  elif member == "roadCameraState":
    m.frameId, m.sensor = n, "ar0231"
  elif member == "deviceState":
    m.deviceType = "tici"
  elif member == "carControl":
    m.latActive = True
  return e


def _hostile(messaging, rng: random.Random, svc: str, n: int):
  """-> (description, Event or raw bytes) with one field of svc made hostile, or another service's Event."""
  if rng.random() < 0.15:
    other = rng.choice([s for s in FIELDS if MEMBER.get(s, s) != MEMBER.get(svc, svc)])
    return f"{other} Event on {svc}", _good(messaging, other, n).to_bytes()
  e = _good(messaging, svc, n)
  member = getattr(e, MEMBER.get(svc, svc))
  f = rng.choice(FIELDS[svc])
  if f == "rpyCalib":
    if rng.random() < 0.3:
      vals = [0.0] * rng.choice((0, 1, 2, 4, 100))
    else:
      vals = [0.0, 0.01, -0.01]
      vals[rng.randrange(3)] = rng.choice(HOSTILE)
    member.rpyCalib = vals
    return f"{svc}.rpyCalib={vals[:4]}", e
  if f == "frameId":
    v = rng.choice((0, 2**32 - 1, n + 10_000))
  elif f in ("isRHD", "latActive"):
    v = rng.random() < 0.5
  elif f == "deviceType":
    v = rng.choice(("pc", "unknown", "tizi", "mici"))
  else:
    v = rng.choice(HOSTILE)
  setattr(member, f, v)
  return f"{svc}.{f}={v}", e


def _finite_model(m) -> bool:
  vals = [m.action.desiredCurvature, m.action.desiredAcceleration, *m.position.x, *m.position.y, *m.orientation.z,
          *m.velocity.x, *m.acceleration.x]
  return all(math.isfinite(v) for v in vals)


def _finite_dm(d) -> bool:
  vals = [d.wheelOnRightProb]
  for side in (d.leftDriverData, d.rightDriverData):
    vals += [*side.faceOrientation, *side.facePosition, side.faceProb, side.leftEyeProb, side.rightEyeProb, side.sunglassesProb]
  return all(math.isfinite(v) for v in vals)


def fuzz_values(modeld_artifact: Path, dm_artifact: Path, seed: int, frames: int, recover: int = 10, progress=None) -> ValuesResult:
  import numpy as np

  from selfdrive_glue import messaging
  from selfdrive_glue.nv12 import nv12_info
  from selfdrive_glue.visionipc import VisionIpcServer, VisionStreamType
  res = ValuesResult()
  rng = random.Random(seed)
  w, h = 1928, 1208
  info = nv12_info(w, h)
  srv = VisionIpcServer("camerad")
  streams = (VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD, VisionStreamType.DRIVER)
  for st in streams:
    srv.create_buffers_with_sizes(st, 4, w, h, info.size, info.stride, info.uv_offset)
  srv.start_listener()
  pub = list(FIELDS) + ["wideRoadCameraState"]
  pm = messaging.PubMaster(pub)
  sm = messaging.SubMaster(["modelV2", "driverStateV2"])
  env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "ERROR"}
  # each process's log into a file: a pipe nobody reads fills up (64 kB of "ignoring ..." lines) and blocks the process
  logs = {svc: tempfile.TemporaryFile("w+") for svc in ("modelV2", "driverStateV2")}
  procs = {
    "modelV2": subprocess.Popen([sys.executable, "-m", "modeld_msm.modeld", "--artifact", str(modeld_artifact), "--demo", "--no-realtime"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs["modelV2"], text=True),
    "driverStateV2": subprocess.Popen([sys.executable, "-m", "modeld_msm.dmonitoringmodeld", "--artifact", str(dm_artifact), "--no-realtime"],
                                      cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs["driverStateV2"], text=True),
  }

  def log_tail(svc: str) -> str:
    logs[svc].seek(0)
    return logs[svc].read()[-1500:]
  frame = np.zeros(info.size, np.uint8)
  frame[: w * h] = 100
  n = 0

  def send_frame(bad: bool) -> None:
    nonlocal n
    n += 1
    for svc in FIELDS:
      if bad and rng.random() < 0.5:
        desc, dat = _hostile(messaging, rng, svc, n)
        res.bad_sent += 1
        res.wrong_member_sent += "Event on" in desc
      else:
        dat = _good(messaging, svc, n)
      pm.send(svc, dat)
    wide = messaging.new_message("wideRoadCameraState", valid=True)
    wide.wideRoadCameraState.frameId = n
    pm.send("wideRoadCameraState", wide)
    for st in streams:
      srv.send(st, frame, n, n * FRAME_NS, n * FRAME_NS + FRAME_NS)

  def collect(timeout: float) -> dict[str, tuple[bool, bool] | None]:
    """(valid, finite) of each process's output for frame n, or None when it sent none in time."""
    got: dict[str, tuple[bool, bool] | None] = {"modelV2": None, "driverStateV2": None}
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(v is None for v in got.values()):
      sm.update(20)
      for svc, check in (("modelV2", _finite_model), ("driverStateV2", _finite_dm)):
        if sm.updated[svc] and sm[svc].frameId == n:
          got[svc] = (bool(sm.valid[svc]), check(sm[svc]))
      for svc, p in procs.items():
        if p.poll() is not None and svc not in [d.split(":")[0] for d in res.died]:
          res.died.append(f"{svc}: exit {p.returncode}: {log_tail(svc)}")
      if res.died:
        break
    return got

  try:
    # start-up: good messages until both answer
    for _ in range(600):
      send_frame(False)
      if all(v is not None for v in collect(0.5).values()) or res.died:
        break
    for i in range(frames):
      if res.died:
        break
      send_frame(True)
      res.frames += 1
      for svc, v in collect(20.0).items():
        if v is None:
          res.missing[svc] += 1
          continue
        valid, finite = v
        res.outputs[svc] += 1
        res.invalid[svc] += not valid
        if valid and not finite and len(res.violations) < 10:
          res.violations.append(f"frame {n}: {svc} valid with NaN/inf")
      if progress:
        progress(i + 1, frames)
    last: dict[str, tuple[bool, bool] | None] = {}
    for _ in range(recover):
      if res.died:
        break
      send_frame(False)
      last = collect(20.0)
    res.recovered = bool(last) and all(v == (True, True) for v in last.values())
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.send_signal(2)
        try:
          p.wait(20)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
    for svc, f in logs.items():
      f.seek(0)
      res.log_lines[svc] = sum(1 for _ in f)
    for f in logs.values():
      f.close()
    srv.close()
  return res


def build_artifacts(tmp: Path) -> tuple[Path, Path]:
  from compile.build import compile_artifact
  from compile.refmodels.dmonitoring import write_dm_model
  from compile.refmodels.driving import write_models
  write_models(tmp / "m", "tiny", 0)
  pair = {"vision": tmp / "m" / "driving_vision.onnx", "policy": tmp / "m" / "driving_policy.onnx"}
  compile_artifact("driving", pair, (1928, 1208), "CPU", tmp / "art", log=lambda *_: None)
  dm = write_dm_model(tmp / "dm", "tiny", 0).path
  compile_artifact("dmonitoring", {"dmonitoring": dm}, (1928, 1208), "CPU", tmp / "dmart", log=lambda *_: None)
  return tmp / "art", tmp / "dmart"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--frames", type=int, default=3000)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--artifact", type=Path, help="a CPU driving artifact for 1928x1208 (default: compile the tiny one)")
  ap.add_argument("--dm-artifact", type=Path, help="a CPU driver-monitoring artifact for 1928x1208 (default: compile the tiny one)")
  args = ap.parse_args()
  os.environ.setdefault("OPENPILOT_PREFIX", f"fuzzv{uuid.uuid4().hex[:6]}")
  with tempfile.TemporaryDirectory() as d:
    art, dm = (args.artifact, args.dm_artifact) if args.artifact and args.dm_artifact else build_artifacts(Path(d))
    t0 = time.monotonic()
    r = fuzz_values(art, dm, args.seed, args.frames,
                    progress=lambda i, k: print(f"  frame {i}/{k}", file=sys.stderr) if i % 250 == 0 else None)
  from artifact.cpu_info import cpu_info
  print(f"CPU: {cpu_info().summary()}")
  print(f"message values fuzz, seed {args.seed}: {r.frames} frames, {r.bad_sent} hostile messages ({r.wrong_member_sent} of the wrong "
        f"union member), {time.monotonic() - t0:.0f} s")
  for svc in r.outputs:
    print(f"  {svc:<14} outputs {r.outputs[svc]:>6}  marked invalid {r.invalid[svc]:>6}  frames without output {r.missing[svc]:>4}")
  print(f"  valid outputs with NaN/inf: {len(r.violations)}; recovered after the bad publisher stopped: {r.recovered}; "
        f"process deaths: {len(r.died)}; lines logged: {r.log_lines}")
  for v in r.violations + r.died:
    print("  ", v)
  return 0 if r.ok else 1


if __name__ == "__main__":
  sys.exit(main())
