"""Both names of every service and stream openpilot master renamed (PRs #38585, #38601, 2026-08): our queues, Events and
VisionIPC ids under either name, checked against openpilot's reference schema both ways, and real modeld /
dmonitoringmodeld processes served by a camera server and publishers that use master's names only.

What is unconfirmed (master's log.capnp could not be read here, docs/openpilot-master-2026-09.md): that each renamed Event
member kept its ordinal. The PR renames in place and defers every change needing compatibility to a later pass, so the
tests hold our side to "same ordinal, same bytes", and say so in their names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from selfdrive_glue import messaging
from selfdrive_glue.services import RENAMED, SERVICES, segment_size
from selfdrive_glue.visionipc import VisionStreamType
from tests.conftest import REPO, ModeldHarness, stop_process

REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "cereal"
# master name -> (0.11 member, a field and the value we put in it)
WIRE = {"narrowRoadCameraState": ("roadCameraState", "frameId", 4242), "cabinCameraState": ("driverCameraState", "frameId", 77),
        "extrinsicsCalibration": ("liveCalibration", "rpyCalib", [0.01, -0.02, 0.03]),
        "lateralDelay": ("liveDelay", "lateralDelay", 0.125)}


def test_every_renamed_service_has_a_queue_of_each_name_and_the_same_size():
  assert {"narrowRoadCameraState", "cabinCameraState", "extrinsicsCalibration", "lateralDelay"} <= set(RENAMED)
  for new, old in RENAMED.items():
    assert SERVICES[new] == SERVICES[old] and segment_size(new) == segment_size(old), new
    assert messaging.MEMBER_OF_SERVICE[new] == old


def test_visionipc_stream_ids_are_the_same_under_masters_names():
  assert VisionStreamType.NARROW_ROAD is VisionStreamType.ROAD and int(VisionStreamType.NARROW_ROAD) == 0
  assert VisionStreamType.CABIN is VisionStreamType.DRIVER and int(VisionStreamType.CABIN) == 1
  assert [t.name for t in VisionStreamType] == ["ROAD", "DRIVER", "WIDE_ROAD", "MAP"]   # iteration (the list reply) unchanged


def _reference(code: str, data: dict) -> dict:
  """Run code with openpilot's reference schema loaded as `ref` (one schema set per process), data in, JSON out."""
  if not (REF / "log.capnp").exists():
    pytest.skip(f"reference schema not found at {REF}")
  prog = textwrap.dedent("""
    import base64, json, sys, capnp
    capnp.remove_import_hook()
    ref = capnp.load(sys.argv[1])
    data = json.loads(sys.stdin.read())
  """) + textwrap.dedent(code)
  r = subprocess.run([sys.executable, "-c", prog, str(REF / "log.capnp")], input=json.dumps(data), capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout)


def _value(v):
  return v if isinstance(v, int | float) else [round(x, 6) for x in v]


def test_masters_events_are_011_members_on_the_wire_ordinal_kept_unconfirmed():
  """Ours -> openpilot's schema: an Event sent on a master queue is the 0.11 member, field for field."""
  import base64
  sent = {}
  for new, (member, field, value) in WIRE.items():
    ev = messaging.new_message(new, valid=True)
    setattr(getattr(ev, member), field, value)
    sent[new] = base64.b64encode(ev.to_bytes()).decode()
  got = _reference("""
    out = {}
    for name, b64 in data.items():
      with ref.Event.from_bytes(base64.b64decode(b64)) as ev:
        m = getattr(ev, ev.which())
        out[name] = [ev.which(), m.to_dict()]
    print(json.dumps(out))
  """, sent)
  for new, (member, field, value) in WIRE.items():
    which, fields = got[new]
    assert which == member and _value(fields[field]) == pytest.approx(value), new


def test_openpilots_bytes_are_taken_on_either_name_ordinal_kept_unconfirmed():
  """openpilot's schema -> ours: its 0.11 member bytes are accepted on the master queue of that service, and a member of
  another service on that queue is still refused."""
  import base64
  raw = _reference("""
    out = {}
    for name, (member, field, value) in data.items():
      ev = ref.Event.new_message(valid=True)
      setattr(ev.init(member), field, value)
      out[name] = base64.b64encode(ev.to_bytes()).decode()
    print(json.dumps(out))
  """, WIRE)
  for new, (member, field, value) in WIRE.items():
    dat = base64.b64decode(raw[new])
    for name in (new, member):
      evt = messaging.checked_event(dat, name)
      assert _value(getattr(messaging.member_of(evt), field)) == pytest.approx(value), name
  with pytest.raises(messaging.BadMessage, match="expected a 'lateralDelay' Event, got 'liveCalibration'"):
    messaging.checked_event(base64.b64decode(raw["extrinsicsCalibration"]), "lateralDelay")


def test_submaster_under_a_master_name_shows_the_member(prefix):
  sm = messaging.SubMaster(["lateralDelay", "narrowRoadCameraState"])
  pm = messaging.PubMaster(["lateralDelay"])
  try:
    assert sm["narrowRoadCameraState"].frameId == 0   # the member's defaults before anything arrived, as for 0.11's name
    ev = messaging.new_message("lateralDelay", valid=True)
    ev.liveDelay.lateralDelay = 0.3125
    dat = ev.to_bytes()
    deadline = time.monotonic() + 10
    while not sm.updated["lateralDelay"] and time.monotonic() < deadline:
      pm.send("lateralDelay", dat)
      sm.update(100)
    assert sm.updated["lateralDelay"] and sm["lateralDelay"].lateralDelay == 0.3125 and sm.bad_messages == 0
  finally:
    sm.close()
    pm.close()


def test_big_is_false_and_writes_no_bytes_so_its_unconfirmed_ordinal_cannot_mislead():
  a, b = messaging.new_message("drivingModelData"), messaging.new_message("drivingModelData", logMonoTime=1)
  a.logMonoTime = 1
  a.drivingModelData.frameId = b.drivingModelData.frameId = 3
  a.drivingModelData.big = False
  assert a.to_bytes() == b.to_bytes()


@pytest.mark.slow
def test_modeld_serves_an_openpilot_that_publishes_masters_names_only(cpu_artifact_1928, prefix):
  """narrowRoadCameraState + extrinsicsCalibration + lateralDelay + VISION_STREAM_NARROW_ROAD, nothing under 0.11's names:
  modeld publishes valid (calibrated) messages, and lateralDelay reaches the action."""
  h = ModeldHarness(cpu_artifact_1928, master_names=True)
  pm = messaging.PubMaster(["lateralDelay"])
  cs = messaging.new_message("carState", valid=True)
  cs.carState.vEgo = 15.0   # moving: below 0.3 m/s modeld holds the curvature, whatever the delay
  car_state = cs.to_bytes()
  try:
    m, _ = h.start(1)
    for n in range(2, 6):
      h.pm.send("carState", car_state)
      m, o = h.step(n)
      # valid = calibrated, and modeld computes the transforms only once it holds the road camera state (its sensor) and a
      # fresh calibration: both came under master's names only
      assert m is not None and h.sm.valid["modelV2"], stop_process(h.proc)
      assert m.frameId == o.frameId == n and m.frameAge == 0
    curvature = m.action.desiredCurvature
    ld = messaging.new_message("lateralDelay", valid=True)
    ld.liveDelay.lateralDelay = 0.9
    dat = ld.to_bytes()
    for n in range(6, 12):
      pm.send("lateralDelay", dat)
      h.pm.send("carState", car_state)
      m, _ = h.step(n)
      assert m is not None, stop_process(h.proc)
    assert m.action.desiredCurvature != curvature   # the lateral action time moved with lateralDelay
  finally:
    pm.close()
    out = h.close()
  assert "Traceback" not in out and "dropped bad message" not in out, out


@pytest.mark.slow
def test_dmonitoringmodeld_serves_an_openpilot_that_publishes_masters_names_only(dm_cpu_artifact, prefix):
  import numpy as np

  from selfdrive_glue.nv12 import nv12_info
  from selfdrive_glue.visionipc import VisionIpcServer
  info = nv12_info(1928, 1208)
  frame = np.random.default_rng(0).integers(0, 256, info.size, dtype=np.uint8)
  srv = VisionIpcServer("camerad")
  srv.create_buffers_with_sizes(VisionStreamType.CABIN, 4, 1928, 1208, info.size, info.stride, info.uv_offset)
  srv.start_listener()
  pm, sm = messaging.PubMaster(["extrinsicsCalibration"]), messaging.SubMaster(["driverStateV2"])
  proc = subprocess.Popen([sys.executable, "-m", "modeld_msm.dmonitoringmodeld", "--artifact", str(dm_cpu_artifact), "--no-realtime"],
                          cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def step(n: int, timeout: float = 20.0):
    srv.send(VisionStreamType.CABIN, frame, n, n * 50_000_000, n * 50_000_000 + 50_000_000)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      sm.update(50)
      if sm.updated["driverStateV2"]:
        return sm["driverStateV2"]
      assert proc.poll() is None, stop_process(proc)
    return None
  try:
    d = next((d for _ in range(400) if (d := step(1, 0.25)) is not None), None)
    assert d is not None, stop_process(proc)
    before = list(step(2).leftDriverData.faceOrientation)
    ec = messaging.new_message("extrinsicsCalibration", valid=True)
    ec.liveCalibration.rpyCalib = [0.0, 0.4, -0.4]
    pm.send("extrinsicsCalibration", ec)
    time.sleep(0.2)
    after = step(3)
    assert after is not None and after.frameId == 3 and list(after.leftDriverData.faceOrientation) != before
  finally:
    out = stop_process(proc)
    srv.close()
    pm.close()
    sm.close()
  assert "Traceback" not in out and "main=driver extra=none" in out, out
