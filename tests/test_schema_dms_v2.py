"""driverMonitoringState after openpilot PR #37799 ("DriverMonitoringState v2", April 2026): the service's Events carry
a new struct at Event @151 (isRHD is its field @7); @71 became driverMonitoringStateDEPRECATED. No reference copy of that
schema is stored, so the newest upstream set is rebuilt here from the facts (docs/openpilot-ipc.md §0 and
§1.2): the stored master-2026-04-15 set with @71 renamed and @151 added, its struct declared field by field. Bytes
written with it must reach modeld's SubMaster with isRHD intact, under our own schema."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from selfdrive_glue import messaging

MASTER = Path(__file__).resolve().parents[2] / "shared" / "reference" / "cereal" / "master-2026-04-15"
if not (MASTER / "log.capnp").exists():
  pytest.skip(f"reference schema not found at {MASTER}", allow_module_level=True)
if messaging.SOURCE != "modeld-msm":
  pytest.skip("reads through our own schema (MODELD_CEREAL=own)", allow_module_level=True)

# upstream's v2 struct as the facts describe it (types and ordinals; the nested structs' contents do not move isRHD)
DMS_V2 = """
struct DriverMonitoringStateV2Upstream {
  lockout @0 :Bool;
  alertCountLockoutPercent @1 :Int8;
  alertTimeLockoutPercent @2 :Int8;
  alwaysOn @3 :Bool;
  alwaysOnLockout @4 :Bool;
  alertLevel @5 :AlertLevel;
  activePolicy @6 :MonitoringPolicy;
  isRHD @7 :Bool;
  rhdCalibration @8 :CalibrationState;
  visionPolicyState @9 :AnyPointer;
  wheeltouchPolicyState @10 :AnyPointer;
  enum AlertLevel { none @0; one @1; two @2; three @3; }
  enum MonitoringPolicy { wheeltouch @0; vision @1; }
  struct CalibrationState { calibratedPercent @0 :Int8; offset @1 :Float32; }
}
"""

WRITER = """
import sys, capnp
capnp.remove_import_hook()
log = capnp.load(sys.argv[1])
out = []
for rhd in (True, False):
  e = log.Event.new_message(valid=True, logMonoTime=123)
  d = e.init("driverMonitoringState")
  d.lockout, d.alertCountLockoutPercent, d.alertTimeLockoutPercent, d.alwaysOn, d.alwaysOnLockout = True, -5, 77, True, True
  d.alertLevel, d.activePolicy, d.isRHD = "three", "vision", rhd
  d.rhdCalibration.calibratedPercent, d.rhdCalibration.offset = 100, 0.25
  out.append(e.to_bytes().hex())
old = log.Event.new_message(valid=True)
old.init("driverMonitoringStateDEPRECATED").isRHD = True
out.append(old.to_bytes().hex())
f = log.DriverMonitoringStateV2Upstream.schema.fields["isRHD"].proto.slot.offset
print(*out, f)
"""


@pytest.fixture(scope="module")
def newest_bytes(tmp_path_factory):
  d = tmp_path_factory.mktemp("newest_cereal")
  for f in MASTER.iterdir():
    if f.name != "log.capnp":
      os.symlink(f, d / f.name)
  text = (MASTER / "log.capnp").read_text()
  old_member = "driverMonitoringState @71: DriverMonitoringState;"
  assert text.count(old_member) == 1
  text = text.replace(old_member, "driverMonitoringStateDEPRECATED @71: DriverMonitoringState;\n    "
                                  "driverMonitoringState @151 :DriverMonitoringStateV2Upstream;")
  (d / "log.capnp").write_text(text + DMS_V2)
  # one schema version per process (duplicate ids abort), so the newest set writes its bytes in a subprocess
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), str(d / "log.capnp")], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  *msgs, rhd_offset = r.stdout.split()
  assert int(rhd_offset) == 3   # isRHD is bit 3 of the data section, after three bools, two int8s and two enums
  return [bytes.fromhex(m) for m in msgs]


def test_newest_driver_monitoring_state_reaches_submaster(newest_bytes):
  rhd, lhd, deprecated = newest_bytes
  sm = messaging.SubMaster(["driverMonitoringState"])
  try:
    for dat, want in ((rhd, True), (lhd, False), (rhd, True), (deprecated, True)):
      sm.update_msgs(1.0, [("driverMonitoringState", dat)])
      assert sm.updated["driverMonitoringState"] and sm.bad_messages == 0
      assert sm["driverMonitoringState"].isRHD is want and sm.valid["driverMonitoringState"]
  finally:
    sm.close()


def test_newest_member_is_named_for_its_service(newest_bytes):
  rhd, _, _ = newest_bytes
  ev = messaging.checked_event(rhd, "driverMonitoringState")
  assert messaging.service_of(ev) == "driverMonitoringState" and ev.logMonoTime == 123
  assert messaging.member_of(ev).isRHD is True
  with pytest.raises(messaging.BadMessage, match="expected a 'carState' Event"):
    messaging.checked_event(rhd, "carState")
