"""PubMaster / SubMaster / new_message / log_from_bytes and Params, with real processes and real capnp bytes."""
import logging
import multiprocessing
import time

import pytest

from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.params import Params, default_params_dir

CTX = multiprocessing.get_context("fork")
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("prefix")]   # plain Linux shared memory and sockets: runs unchanged on a vamOS device


def _car_state(v: float, valid=True) -> bytes:
  e = messaging.new_message("carState", valid=valid)
  e.carState.vEgo = v
  return e.to_bytes()


def test_new_message_defaults():
  t0 = time.monotonic_ns()
  e = messaging.new_message("modelV2")
  assert e.which() == "modelV2" and e.valid is False and t0 <= e.logMonoTime <= time.monotonic_ns()
  assert messaging.new_message("cameraOdometry", valid=True).valid is True
  assert messaging.new_message().logMonoTime > 0


def test_log_from_bytes_round_trip_and_bad_input():
  e = messaging.new_message("modelV2", valid=True)
  e.modelV2.frameId = 42
  e.modelV2.position.x = [1.0, 2.0]
  raw = e.to_bytes()
  r = messaging.log_from_bytes(raw)
  assert r.which() == "modelV2" and r.modelV2.frameId == 42 and list(r.modelV2.position.x) == [1.0, 2.0] and r.valid
  for bad in (b"", b"\x01" * 7, b"\x01" * 40, raw[:16]):
    with pytest.raises(messaging.BadMessage):
      messaging.checked_event(bad)
  with pytest.raises(messaging.BadMessage, match="expected a 'carState'"):
    messaging.checked_event(raw, "carState")


def test_services_table():
  assert messaging.SERVICES["modelV2"] == (True, 20., None, 10 * 1024 * 1024)
  assert messaging.SERVICES["carState"] == (True, 100., 10, 250 * 1024)
  assert messaging.SERVICES["controlsState"][3] == 2 * 1024 * 1024
  assert messaging.SERVICES["liveDelay"][1] == 4. and messaging.SERVICES["deviceState"][1] == 2.


def _publisher(n, hz):
  pm = messaging.PubMaster(["carState", "modelV2"])
  while pm.sock["modelV2"].q.num_readers() < 1:
    time.sleep(0.005)
  time.sleep(0.05)
  t0 = time.monotonic()
  for i in range(n):
    cs = messaging.new_message("carState", valid=True)
    cs.carState.vEgo = float(i)
    pm.send("carState", cs)
    m = messaging.new_message("modelV2", valid=i % 2 == 0)
    m.modelV2.frameId = i
    pm.send("modelV2", m.to_bytes())
    time.sleep(max(0., t0 + (i + 1) / hz - time.monotonic()))


def test_pub_sub_across_processes():
  sm = messaging.SubMaster(["carState", "modelV2"], poll="modelV2")
  assert not sm.seen["modelV2"] and not sm.alive["modelV2"] and not sm.valid["modelV2"]
  assert sm["modelV2"].frameId == 0  # defaults before anything arrives
  proc = CTX.Process(target=_publisher, args=(20, 50))
  proc.start()
  frames, deadline = [], time.monotonic() + 10
  while (not frames or frames[-1] < 19) and time.monotonic() < deadline:
    sm.update(200)
    if sm.updated["modelV2"]:
      frames.append(sm["modelV2"].frameId)
      assert sm.valid["modelV2"] == (frames[-1] % 2 == 0)
      assert sm.recv_frame["modelV2"] == sm.frame
  proc.join(5)
  assert frames and frames[-1] == 19 and frames == sorted(frames)
  assert sm.seen["carState"] and sm.alive["carState"] and sm["carState"].vEgo >= frames[0]
  assert 0 < sm.logMonoTime["modelV2"] <= time.monotonic_ns()
  assert sm.bad_messages == 0


def test_freq_ok_and_alive_follow_arrival_times():
  sm = messaging.SubMaster(["carState", "modelV2", "liveCalibration"], poll="modelV2")
  t = 1000.
  for i in range(60):          # modelV2 20 Hz, carState 100 Hz (5 per update), liveCalibration 4 Hz
    t += 0.05
    msgs = [("modelV2", messaging.new_message("modelV2", valid=True).to_bytes()), ("carState", _car_state(i))]
    if i % 5 == 0:
      msgs.append(("liveCalibration", messaging.new_message("liveCalibration", valid=True).to_bytes()))
    sm.update_msgs(t, msgs)
  assert sm.all_checks(), (sm.alive, sm.freq_ok, sm.valid)
  t += 0.05
  sm.update_msgs(t, [("modelV2", messaging.new_message("modelV2", valid=True).to_bytes())])
  for _ in range(40):           # modelV2 keeps coming at 10 Hz: half the rate it should
    t += 0.1
    sm.update_msgs(t, [("modelV2", messaging.new_message("modelV2", valid=True).to_bytes())])
  assert not sm.freq_ok["modelV2"] and sm.alive["modelV2"]
  assert not sm.alive["carState"]   # nothing for > 10 / 100 Hz
  assert sm.alive["liveCalibration"] is False   # 10 / 4 Hz = 2.5 s have passed
  assert not sm.all_checks() and sm.all_checks(["liveCalibration"]) is False


def test_on_demand_services_start_alive():
  sm = messaging.SubMaster(["userBookmark", "carState"])
  sm.update(0)
  assert sm.alive["userBookmark"] and sm.freq_ok["userBookmark"] and sm.valid["userBookmark"]
  assert not sm.alive["carState"] and not sm.valid["carState"]
  assert sm.all_checks(["userBookmark"]) and not sm.all_checks()


def test_bad_messages_are_counted_and_skipped(caplog):
  sm = messaging.SubMaster(["carState"])
  pub = messaging.pub_sock("carState")
  sm.update(0)  # re-register after the publisher took over the queue
  pub.send(_car_state(3.0))
  sm.update(100)
  assert sm.updated["carState"] and sm["carState"].vEgo == 3.0
  good = _car_state(4.0)
  wrong = messaging.new_message("modelV2").to_bytes()
  with caplog.at_level(logging.WARNING):
    for bad in (b"\xff" * 64, good[:len(good) // 2 // 8 * 8], wrong):
      pub.send(bad)
      sm.update(100)
      assert not sm.updated["carState"]
  assert sm.bad_messages == 3 and sm["carState"].vEgo == 3.0
  assert sum("dropped bad message on 'carState'" in r.message for r in caplog.records) == 1
  pub.send(good)
  sm.update(100)
  assert sm.updated["carState"] and sm["carState"].vEgo == 4.0


def _one_shot(tag):
  pm = messaging.PubMaster(["liveDelay"])
  while pm.sock["liveDelay"].q.num_readers() < 1:
    time.sleep(0.005)
  for _ in range(3):
    m = messaging.new_message("liveDelay", valid=True)
    m.liveDelay.lateralDelay = tag
    pm.send("liveDelay", m)
    time.sleep(0.02)


def test_submaster_survives_publisher_restart():
  sm = messaging.SubMaster(["liveDelay"])
  for tag in (0.25, 0.5):
    proc = CTX.Process(target=_one_shot, args=(tag,))
    proc.start()
    deadline = time.monotonic() + 10
    while sm["liveDelay"].lateralDelay != tag and time.monotonic() < deadline:
      sm.update(100)
    proc.join(5)
    assert sm["liveDelay"].lateralDelay == tag


def test_pubmaster_readers_updated():
  pm = messaging.PubMaster(["cameraOdometry"])
  assert not pm.all_readers_updated("cameraOdometry")   # no readers at all
  sock = messaging.sub_sock("cameraOdometry")
  pm.send("cameraOdometry", messaging.new_message("cameraOdometry"))
  assert not pm.all_readers_updated("cameraOdometry")
  assert messaging.recv_one_or_none(sock).which() == "cameraOdometry"
  assert pm.wait_for_readers_to_update("cameraOdometry", 1.0)


def test_unknown_service_is_refused():
  with pytest.raises(messaging.IpcError, match="unknown service"):
    messaging.SubMaster(["notAService"])


def test_params_round_trip(tmp_path, monkeypatch):
  monkeypatch.setenv("PARAMS_ROOT", str(tmp_path))
  assert default_params_dir() == tmp_path / "d"
  p = Params()
  assert p.get("CarParams") is None
  cp = messaging.car.CarParams.new_message(carFingerprint="HONDA_CIVIC", longitudinalActuatorDelay=0.5)
  p.put("CarParams", cp.to_bytes())
  with messaging.car.CarParams.from_bytes(p.get("CarParams")) as r:
    assert r.carFingerprint == "HONDA_CIVIC" and r.longitudinalActuatorDelay == 0.5
  assert sorted(f.name for f in (tmp_path / "d").iterdir()) == ["CarParams"]   # no temp files left behind
  p.put_bool("IsRhdDetected", True)
  assert p.get_bool("IsRhdDetected") and p.get("IsRhdDetected") == b"1"
  with pytest.raises(UserError, match="bad params key"):
    p.get("../etc/passwd")


def test_params_default_dir_honours_prefix(monkeypatch, tmp_path):
  monkeypatch.delenv("PARAMS_ROOT", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("OPENPILOT_PREFIX", "abc")
  if default_params_dir() != __import__("pathlib").Path("/data/params/d"):
    assert default_params_dir() == tmp_path / ".commaabc" / "params" / "d"


def test_the_newest_masters_extrinsics_calibration_reads_as_the_calibration_it_renames():
  # a capnp rename keeps the member's ordinal, so master's extrinsicsCalibration Event is our liveCalibration member
  assert messaging.SERVICES["extrinsicsCalibration"] == messaging.SERVICES["liveCalibration"]
  lc = messaging.new_message("liveCalibration", valid=True)
  lc.liveCalibration.rpyCalib = [0.0, 0.02, -0.01]
  evt = messaging.checked_event(lc.to_bytes(), "extrinsicsCalibration")
  assert list(messaging.member_of(evt).rpyCalib) == pytest.approx([0.0, 0.02, -0.01])
  with pytest.raises(messaging.BadMessage, match="expected a 'extrinsicsCalibration' Event, got 'carState'"):
    messaging.checked_event(_car_state(1.0), "extrinsicsCalibration")
