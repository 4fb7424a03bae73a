"""driverStateV2 (Event @92, what dmonitoringmodeld publishes) through our schema against openpilot's, real bytes both
ways, every field. Two stored reference sets differ here: the 0.11 set has DriverData up to @13 with DEPRECATED-suffixed
names, the master-2026-04-15 set moves deprecated fields into `deprecated` groups and adds @14 eyesVisibleProb and @15
eyesClosedProb. We call @14 sleepProb (its name since openpilot PR #38049): same Float32 slot, same bytes.

Both reference sets share file ids, so each is loaded in its own child process ("Duplicate ID" otherwise)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from selfdrive_glue import messaging

REF_ROOT = Path(__file__).resolve().parents[2] / "shared" / "reference" / "cereal"
if not (REF_ROOT / "log.capnp").exists():
  pytest.skip(f"reference schema not found at {REF_ROOT}", allow_module_level=True)
if messaging.SOURCE != "modeld-msm":
  pytest.skip("reads through our own schema (MODELD_CEREAL=own)", allow_module_level=True)

REF_SETS = {"0.11": REF_ROOT, "master-2026-04-15": REF_ROOT / "master-2026-04-15"}
SIDES = ("leftDriverData", "rightDriverData")
LIST_LENGTHS = {"faceOrientation": 3, "faceOrientationStd": 3, "facePosition": 2, "facePositionStd": 2, "readyProb": 4,
                "notReadyProb": 2}
DRIVER_DATA = ["faceOrientation", "faceOrientationStd", "facePosition", "facePositionStd", "faceProb", "leftEyeProb",
               "rightEyeProb", "leftBlinkProb", "rightBlinkProb", "sunglassesProb", "occludedProb", "readyProb",
               "notReadyProb", "phoneProb", "sleepProb", "eyesClosedProb"]
TOP = ["frameId", "modelExecutionTime", "unused2", "rawPredictions", "unused4", "wheelOnRightProb", "gpuExecutionTime"]

# our field -> the reference set's name for the same slot (None: the set has no such ordinal)
_DEPRECATED_DD = ["leftEyeProb", "rightEyeProb", "leftBlinkProb", "rightBlinkProb", "sunglassesProb", "occludedProb",
                  "readyProb", "notReadyProb"]
REF_NAMES = {
  "0.11": {"unused2": "dspExecutionTimeDEPRECATED", "unused4": "poorVisionProbDEPRECATED",
           "occludedProb": "occludedProbDEPRECATED", "readyProb": "readyProbDEPRECATED",
           "notReadyProb": "notReadyProbDEPRECATED", "sleepProb": None, "eyesClosedProb": None},
  "master-2026-04-15": {"unused2": "deprecated.dspExecutionTime", "unused4": "deprecated.poorVisionProb",
                        **{n: f"deprecated.{n}" for n in _DEPRECATED_DD}, "sleepProb": "eyesVisibleProb"},
}

CHILD = """
import json, sys
import capnp
capnp.remove_import_hook()
log = capnp.load(sys.argv[1])
req = json.loads(sys.stdin.read())

def walk(obj, dotted):
  for part in filter(None, dotted.split(".")):
    obj = getattr(obj, part)
  return obj

def plain(v):
  if isinstance(v, bytes):
    return {"hex": v.hex()}
  return v if isinstance(v, (int, float)) else list(v)

if req["mode"] == "read":
  with log.Event.from_bytes(bytes.fromhex(req["bytes"])) as ev:
    ds = ev.driverStateV2
    out = {"which": str(ev.which()), "logMonoTime": ev.logMonoTime, "valid": ev.valid,
           "fields": {p: plain(walk(ds, p)) for p in req["paths"]}}
else:
  ev = log.Event.new_message(logMonoTime=req["logMonoTime"], valid=True)
  ds = ev.init("driverStateV2")
  for side in ("leftDriverData", "rightDriverData"):
    ds.init(side)
  for p, v in req["fields"].items():
    head, _, last = p.rpartition(".")
    setattr(walk(ds, head), last, bytes.fromhex(v["hex"]) if isinstance(v, dict) else v)
  out = {"bytes": ev.to_bytes().hex()}
print(json.dumps(out))
"""


def _f32(x: float) -> float:
  return float(np.float32(x))


def _values() -> dict:
  """Every field (our dotted names), distinct and not exactly representable before float32 rounding."""
  counter = iter(range(1, 1000))

  def nxt(sign=1.0):
    return _f32(sign * (0.0013 + 0.0173 * next(counter)))

  v = {"frameId": 3_987_654_321, "modelExecutionTime": nxt(), "unused2": nxt(), "unused4": nxt(), "wheelOnRightProb": nxt(),
       "gpuExecutionTime": nxt(), "rawPredictions": np.linspace(-3.3, 7.7, 37, dtype=np.float32).tobytes() + b"\x01\xfe\x00\x7f"}
  for side in SIDES:
    for name in DRIVER_DATA:
      n = LIST_LENGTHS.get(name)
      v[f"{side}.{name}"] = nxt() if n is None else [nxt(-1.0 if i % 2 else 1.0) for i in range(n)]
  assert len({json.dumps(_plain(x)) for x in v.values()}) == len(v)
  return v


def _ref_path(ref_set: str, ours: str) -> str | None:
  head, _, name = ours.rpartition(".")
  ref = REF_NAMES[ref_set].get(name, name)
  return None if ref is None else ".".join(filter(None, (head, ref)))


def _child(ref_set: str, req: dict) -> dict:
  ref = REF_SETS[ref_set]
  if not (ref / "log.capnp").exists():
    pytest.skip(f"reference set {ref_set} not found at {ref}")
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(ref / "log.capnp")], input=json.dumps(req),
                     capture_output=True, text=True, timeout=60, env={**os.environ})
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout)


def _plain(v):
  return {"hex": v.hex()} if isinstance(v, bytes) else v


def _ours_event(values: dict):
  ev = messaging.new_message("driverStateV2", logMonoTime=123_456_789_012, valid=True)
  ds = ev.driverStateV2
  for side in SIDES:
    ds.init(side)
  for p, x in values.items():
    head, _, last = p.rpartition(".")
    setattr(getattr(ds, head) if head else ds, last, x)
  return ev


def _reference_bytes(ref_set: str, values: dict) -> bytes:
  fields = {rp: _plain(x) for p, x in values.items() if (rp := _ref_path(ref_set, p)) is not None}
  return bytes.fromhex(_child(ref_set, {"mode": "write", "logMonoTime": 987_654_321_098, "fields": fields})["bytes"])


def _read_ours(ds, path: str):
  head, _, last = path.rpartition(".")
  v = getattr(getattr(ds, head) if head else ds, last)
  return v if isinstance(v, (bytes, int, float)) else list(v)


@pytest.mark.parametrize("ref_set", REF_SETS)
def test_ours_to_reference(ref_set):
  values = _values()
  paths = {p: rp for p in values if (rp := _ref_path(ref_set, p)) is not None}
  got = _child(ref_set, {"mode": "read", "bytes": _ours_event(values).to_bytes().hex(), "paths": list(paths.values())})
  assert (got["which"], got["logMonoTime"], got["valid"]) == ("driverStateV2", 123_456_789_012, True)
  for p, rp in paths.items():
    assert got["fields"][rp] == _plain(values[p]), f"{p} read by {ref_set} as {rp}"
  for side in SIDES:
    assert [len(got["fields"][paths[f"{side}.{n}"]]) for n in LIST_LENGTHS] == list(LIST_LENGTHS.values())
  dropped = {p for p in values if p not in paths}
  assert dropped == ({f"{s}.{n}" for s in SIDES for n in ("sleepProb", "eyesClosedProb")} if ref_set == "0.11" else set())
  if ref_set == "master-2026-04-15":
    assert got["fields"]["leftDriverData.eyesVisibleProb"] == values["leftDriverData.sleepProb"]


@pytest.mark.parametrize("ref_set", REF_SETS)
def test_reference_to_ours(ref_set):
  values = _values()
  dat = _reference_bytes(ref_set, values)
  ev = messaging.checked_event(dat, "driverStateV2")
  assert (ev.logMonoTime, ev.valid) == (987_654_321_098, True)
  ds = ev.driverStateV2
  for p, x in values.items():
    want = x if _ref_path(ref_set, p) is not None else 0.0   # an older writer leaves @14/@15 unset: they read as 0
    assert _read_ours(ds, p) == want, f"{p} written by {ref_set}"
  for side in SIDES:
    dd = getattr(ds, side)
    assert [len(getattr(dd, n)) for n in LIST_LENGTHS] == list(LIST_LENGTHS.values())


@pytest.mark.parametrize("ref_set", REF_SETS)
def test_event_union_discriminant(ref_set):
  dat = _reference_bytes(ref_set, {"frameId": 41, "leftDriverData.faceProb": _f32(0.93)})
  with messaging.log.Event.from_bytes(dat) as ev:
    assert ev.which() == "driverStateV2"
    assert messaging.service_of(ev) == "driverStateV2"
  sm = messaging.SubMaster(["driverStateV2"])
  try:
    sm.update_msgs(1.0, [("driverStateV2", dat)])
    assert sm.updated["driverStateV2"] and sm.valid["driverStateV2"] and sm.bad_messages == 0
    assert sm["driverStateV2"].frameId == 41 and sm["driverStateV2"].leftDriverData.faceProb == _f32(0.93)
  finally:
    sm.close()
