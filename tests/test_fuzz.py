"""Fixed-seed fuzzing of the readers modeld takes untrusted bytes from (testing/fuzz.py has the mutators and the contracts),
plus the inputs the fuzzer found that used to kill the process, as regression cases."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))
import fuzz  # noqa: E402

from selfdrive_glue import messaging  # noqa: E402
from selfdrive_glue.capnp_check import CorruptMessage, check_pointers  # noqa: E402


@pytest.mark.parametrize("target", ["submaster", "logreader", "vipc", "carparams"])
def test_fuzz_no_crashes(target, prefix, tmp_path):
  res = fuzz.fuzz_logreader(7, 300, tmp_path) if target == "logreader" else fuzz.TARGETS[target](7, 300)
  assert res.tried == 300
  assert res.crashes == 0, "\n".join(res.examples)
  assert res.clean_errors > 0   # the inputs were bad enough to be refused: the fuzzer is not feeding only valid data


def _event(service="liveDelay") -> bytearray:
  e = messaging.new_message(service, valid=True)
  return bytearray(e.to_bytes())


def test_out_of_bounds_struct_pointer_is_refused_not_aborted(prefix):
  # pycapnp's total_size (what checked_event used) hit std::terminate on this: the root's member pointer made to point
  # past the segment. Now a BadMessage, counted by SubMaster.
  b = _event()
  root_data, = struct.unpack_from("<H", b, 8 + 4)   # root struct pointer: data words
  member = 8 + 8 + 8 * root_data                     # the union member is the root's first pointer
  ref, = struct.unpack_from("<Q", b, member)
  struct.pack_into("<Q", b, member, (ref & ~0xFFFFFFFC) | (0x1000 << 2))
  with pytest.raises(CorruptMessage):
    check_pointers(bytes(b))
  with pytest.raises(messaging.BadMessage):
    messaging.checked_event(bytes(b), "liveDelay")
  sm = messaging.SubMaster(["liveDelay"])
  try:
    sm.update_msgs(1.0, [("liveDelay", bytes(b))])
    assert sm.bad_messages == 1 and not sm.updated["liveDelay"]
  finally:
    sm.close()


def test_capability_and_far_loop_pointers_are_refused():
  b = _event()
  cap = bytearray(b)
  struct.pack_into("<Q", cap, 8, 3)                 # root pointer -> a capability (pycapnp aborts copying one)
  with pytest.raises(CorruptMessage, match="capability"):
    check_pointers(bytes(cap))
  loop = bytearray(b)
  struct.pack_into("<Q", loop, 8, 2)                # root: single far pointer to segment 0 word 0, i.e. itself
  with pytest.raises(CorruptMessage, match="far"):
    check_pointers(bytes(loop))


def test_pointer_amplification_is_refused():
  # a list of 4000 pointers that all point at one 4000-word list: 16M words to visit in an 8k-word message
  n = 4000
  words = [0] * (1 + 1 + n + n)
  words[0] = 1 | (0 << 2) | (6 << 32) | (n << 35)   # root: list of n pointers right after it
  for i in range(n):
    at = 1 + i
    target = 1 + n
    words[at] = 1 | (((target - at - 1) & 0x3FFFFFFF) << 2) | (5 << 32) | (n << 35)   # each: list of n 64-bit words
  body = struct.pack(f"<{len(words)}Q", *words)
  msg = struct.pack("<II", 0, len(words)) + body
  with pytest.raises(CorruptMessage, match="amplification"):
    check_pointers(msg)


def test_multi_segment_messages_pass():
  e = messaging.new_message("modelV2", valid=True)
  e.modelV2.rawPredictions = bytes(200_000)   # past the first segment: the builder links segments with far pointers
  ll = e.modelV2.init("laneLines", 4)
  for x in ll:
    x.y = [1.0] * 33
  b = e.to_bytes()
  assert struct.unpack_from("<I", b)[0] >= 1
  check_pointers(b)
  assert messaging.checked_event(b, "modelV2").modelV2.laneLines[3].y[5] == 1.0


def test_vipc_descriptor_longer_than_its_fd_is_refused(prefix):
  # a mapping longer than the fd reads as SIGBUS; the client must refuse the reply instead
  import os

  from selfdrive_glue.nv12 import nv12_info
  from selfdrive_glue.visionipc import _DESC, VisionIpcClient
  g = nv12_info(64, 48)
  fd = os.memfd_create("short", os.MFD_CLOEXEC)
  os.ftruncate(fd, 4096)   # far shorter than the frame the descriptor claims
  srv = fuzz.FakeServer("shortbuf")
  try:
    srv.reply = (_DESC.pack(g.size, g.size + 8, 0, 0, fd, 64, 48, g.stride, g.uv_offset, 0, 0, 1, 0, 0, 0), [fd])
    c = VisionIpcClient("shortbuf", 0, conflate=False)
    assert not c.connect(False) and c.buffers == []
    os.ftruncate(fd, g.size + 8)
    assert c.connect(False) and c.buffers[0].len == g.size
    c.close()
  finally:
    srv.close()
    os.close(fd)


def test_received_messages_leave_no_cyclic_garbage(prefix):
  """serve runs with gc disabled (config_realtime, like openpilot), so anything a receive leaves in a reference cycle is
  never freed: the pointer check's closures once kept every received message (~9.5 KB a frame in the soak)."""
  import gc
  pm = messaging.PubMaster(["carState", "liveCalibration"])
  sm = messaging.SubMaster(["carState", "liveCalibration"])
  try:
    def step(i: int) -> None:
      m = messaging.new_message("liveCalibration")
      m.liveCalibration.rpyCalib = [0.0, 0.001 * i, 0.0]
      pm.send("liveCalibration", m)
      c = messaging.new_message("carState")
      c.carState.vEgo = float(i)
      pm.send("carState", c)
      sm.update(0)
      check_pointers(sm["carState"].as_builder().to_bytes())
    for i in range(20):   # warm-up: first-use caches
      step(i)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
      for i in range(300):
        step(i)
      garbage = gc.collect()
    finally:
      if was:
        gc.enable()
    assert sm.seen["carState"] and sm["carState"].vEgo == 299.0
    assert garbage < 50, f"{garbage} objects in reference cycles after 300 receives (each one is kept forever with gc disabled)"
  finally:
    sm.close()

