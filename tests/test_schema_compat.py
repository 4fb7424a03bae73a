"""Our cereal schema against openpilot 0.11's (../shared/reference/cereal): identical layout, and real bytes both ways."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import capnp
import pytest

from selfdrive_glue.schema import SCHEMA_DIR, car, log

REF_ROOT = Path(__file__).resolve().parents[2] / "shared" / "reference" / "cereal"
# one schema version per process (duplicate ids abort), so other reference sets are checked in a subprocess
REF = Path(os.environ.get("SCHEMA_REF_DIR", REF_ROOT))
if not (REF / "log.capnp").exists():
  pytest.skip(f"reference schema not found at {REF}", allow_module_level=True)

capnp.remove_import_hook()
ref_log = capnp.load(str(REF / "log.capnp"))
ref_car = capnp.load(str(REF / "car.capnp"))

EVENT_MEMBERS = ["modelV2", "drivingModelData", "cameraOdometry", "carState", "roadCameraState", "wideRoadCameraState", "deviceState",
                 "liveCalibration", "driverMonitoringState", "carControl", "liveDelay", "carParams", "initData", "roadEncodeIdx",
                 "wideRoadEncodeIdx", "driverCameraState", "driverEncodeIdx"]
SIZE_BITS = {"void": 0, "bool": 1, "int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "enum": 16, "int32": 32, "uint32": 32,
             "float32": 32, "int64": 64, "uint64": 64, "float64": 64}


# Event members of openpilot versions newer than a reference set: absent there, so not compared with it. @150 is in the
# master set; @151 (driverMonitoringState v2, PR #37799) in none of them: tests/test_schema_dms_v2.py checks it.
# DriverData @14/@15 arrived after the 0.11 set (the master set has them); plain fields like these make a struct larger.
_DRIVER_DATA = [f"Event.driverStateV2@92.{side}DriverData@{n}" for side, n in (("left", 6), ("right", 7))]
# modelV2.big @27 and drivingModelData.big @8: master since 2026-08/09 (PRs #38555, #38747), ordinals unconfirmed
# (tests/test_master_names.py); a Bool appended to a struct, so absent from every reference set
NEWER_THAN_REFERENCE = {"Event": {150, 151}, **{p: {14, 15} for p in _DRIVER_DATA}, "Event.modelV2@75": {27}, "Event.drivingModelData@128": {8}}
NEWER_FIELDS = {("ModelDataV2", "big"), ("DrivingModelData", "big")}   # (struct, field): skipped where the other side lacks it
# The same slot under another upstream name (ordinal, type and offset are still compared): the 0.11 set marks DriverData
# @10-@12 with a DEPRECATED suffix; the master set names @14 eyesVisibleProb, renamed sleepProb upstream by PR #38049.
# tests/test_schema_driver_state.py checks these fields' values against both sets.
UPSTREAM_NAMES = {"occludedProb": {"occludedProbDEPRECATED"}, "readyProb": {"readyProbDEPRECATED"},
                  "notReadyProb": {"notReadyProbDEPRECATED"}, "sleepProb": {"eyesVisibleProb"}}


def _is_placeholder(f) -> bool:
  return f.name.startswith("unused") or (f.which() == "slot" and f.slot.type.which() == "anyPointer")


def _flat_fields(schema, group=""):
  """{ordinal: (field proto, owning schema)} with groups flattened (ordinals are unique across a struct and its groups;
  upstream later moved deprecated fields into groups without changing layout), plus each group's struct node."""
  out, groups = {}, {group: schema.node.struct}
  for f in schema.node.struct.fields:
    if f.which() == "group":
      sub_out, sub_groups = _flat_fields(schema.fields[f.name].schema, f"{group}.{f.name}")
      out.update(sub_out)
      groups.update(sub_groups)
    else:
      out[f.ordinal.explicit] = (f, schema)
  return out, groups


def _check_layout(ours, ref, path, seen):
  if path in seen:
    return 0
  seen.add(path)
  o_fields, o_groups = _flat_fields(ours)
  r_fields, r_groups = _flat_fields(ref)
  assert ours.node.id != ref.node.id, f"{path}: struct id must differ from openpilot's"
  if all(o_fields[k][0].discriminantValue != 0xFFFF for k in set(o_fields) - set(r_fields)):  # newer union members only
    assert ours.node.struct.dataWordCount <= ref.node.struct.dataWordCount, path
    assert ours.node.struct.pointerCount <= ref.node.struct.pointerCount, path
  for g, node in o_groups.items():
    if node.discriminantCount:
      assert g in r_groups, f"{path}{g}: union missing in reference"
      assert node.discriminantOffset == r_groups[g].discriminantOffset, f"{path}{g}: union tag moved"
  checked = 0
  for key, (f, owner) in o_fields.items():
    if key not in r_fields and key in NEWER_THAN_REFERENCE.get(path, ()):
      continue
    assert key in r_fields, f"{path}{key}: ordinal not in the reference"
    rf, rowner = r_fields[key]
    where = f"{path}.{f.name}@{key}"
    assert f.discriminantValue == rf.discriminantValue, f"{where}: union discriminant differs"
    ot, rt = f.slot.type.which(), rf.slot.type.which()
    assert SIZE_BITS.get(ot, "ptr") == SIZE_BITS.get(rt, "ptr"), f"{where}: size {ot} vs {rt}"
    assert f.slot.offset == rf.slot.offset, f"{where}: offset {f.slot.offset} vs {rf.slot.offset}"
    checked += 1
    if _is_placeholder(f):
      continue
    assert (f.name == rf.name or rf.name in UPSTREAM_NAMES.get(f.name, ())) and ot == rt, \
      f"{where}: named/typed {ot}, reference has {rf.name}:{rt}"
    if f.slot.hadExplicitDefault or rf.slot.hadExplicitDefault:
      assert f.slot.defaultValue.to_dict() == rf.slot.defaultValue.to_dict(), f"{where}: default differs"
    if ot in ("struct", "enum", "list"):
      osch, rsch = owner.fields[f.name].schema, rowner.fields[rf.name].schema
      if ot == "list":
        lt, rlt = f.slot.type.list.elementType.which(), rf.slot.type.list.elementType.which()
        assert lt == rlt, f"{where}: list of {lt} vs {rlt}"
        if lt not in ("struct", "enum"):
          continue
        osch, rsch, ot = osch.elementType, rsch.elementType, lt
      if ot == "enum":
        assert dict(osch.enumerants) == dict(rsch.enumerants), f"{where}: enumerants differ"
      else:
        checked += _check_layout(osch, rsch, f"{where}", seen)
  return checked


def test_layout_matches_reference():
  seen: set[str] = set()
  n = _check_layout(log.Event.schema, ref_log.Event.schema, "Event", seen)
  n += _check_layout(car.CarParams.schema, ref_car.CarParams.schema, "CarParams", seen)
  assert n > 500  # every Event member and the structs under the typed ones were compared


def test_file_ids_differ_and_both_load():
  ours = {(SCHEMA_DIR / f).read_text().split("\n@0x", 1)[1][:16] for f in ("log.capnp", "car.capnp")}
  refs = {(REF / f).read_text().split("\n@0x", 1)[1][:16] for f in ("log.capnp", "car.capnp")}
  assert not ours & refs


# ---- values: fill every typed field with a non-default value, encode with one schema, decode with the other ----

def _value(kind: str, seed: int, enum_schema=None):
  if kind == "bool":
    return True
  if kind in ("int8", "uint8"):
    return 3 + seed % 100
  if kind in ("int16", "int32", "uint16", "uint32"):
    return 1000 + seed
  if kind in ("int64", "uint64"):
    return (1 << 40) + seed
  if kind in ("float32", "float64"):
    return seed + 0.5
  if kind == "text":
    return f"t{seed}"
  if kind == "data":
    return bytes([seed % 256, 1, 2, 3, 250])
  if kind == "enum":
    return max(enum_schema.enumerants.items(), key=lambda kv: kv[1])[0]
  raise AssertionError(kind)


def _typed_fields(schema, *others):
  """others: builders or readers of the other schema; a NEWER_FIELDS member one of them lacks is left out."""
  struct = schema.node.displayName.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
  return [f for f in schema.node.struct.fields if f.which() == "slot" and not _is_placeholder(f) and f.discriminantValue == 0xFFFF
          and not ((struct, f.name) in NEWER_FIELDS and any(f.name not in o.schema.fieldnames for o in others))]


def _fill(b, schema, seed=1):
  for f in _typed_fields(schema, b):
    seed += 7
    kind = f.slot.type.which()
    fs = schema.fields[f.name].schema if kind in ("struct", "enum", "list") else None
    if kind == "struct":
      _fill(b.init(f.name), fs, seed)
    elif kind == "list":
      ek = f.slot.type.list.elementType.which()
      if ek == "struct":
        lst = b.init(f.name, 2)
        for i in range(2):
          _fill(lst[i], fs.elementType, seed + 100 * i)
      else:
        setattr(b, f.name, [_value(ek, seed + i, fs.elementType if ek == "enum" else None) for i in range(3)])
    else:
      setattr(b, f.name, _value(kind, seed, fs))


def _compare(a, b, schema, path):
  n = 0
  for f in _typed_fields(schema, a, b):
    kind = f.slot.type.which()
    va, vb = getattr(a, f.name), getattr(b, f.name)
    where = f"{path}.{f.name}"
    if kind == "struct":
      n += _compare(va, vb, schema.fields[f.name].schema, where)
    elif kind == "list":
      assert len(va) == len(vb) > 0, where
      if f.slot.type.list.elementType.which() == "struct":
        for i in range(len(va)):
          n += _compare(va[i], vb[i], schema.fields[f.name].schema.elementType, f"{where}[{i}]")
      else:
        assert list(va) == list(vb), where
        n += 1
    else:
      assert va == vb, f"{where}: {va!r} != {vb!r}"
      n += 1
  return n


def _member_schema(schema_mod, member):
  return schema_mod.Event.schema.fields[member].schema


@pytest.mark.parametrize("member", EVENT_MEMBERS)
def test_ours_to_reference(member):
  ev = log.Event.new_message(logMonoTime=123456789, valid=False)
  _fill(ev.init(member), _member_schema(log, member))
  with ref_log.Event.from_bytes(ev.to_bytes()) as r:
    assert r.which() == member and r.logMonoTime == 123456789 and r.valid is False
    n = _compare(getattr(ev.as_reader(), member), getattr(r, member), _member_schema(log, member), member)
  assert n >= 3


@pytest.mark.parametrize("member", EVENT_MEMBERS)
def test_reference_to_ours(member):
  ev = ref_log.Event.new_message(logMonoTime=987654321)
  _fill(ev.init(member), _member_schema(log, member))  # our field names, set on openpilot's builder
  with log.Event.from_bytes(ev.to_bytes()) as r:
    assert r.which() == member and r.logMonoTime == 987654321 and r.valid is True
    n = _compare(r.__getattr__(member), getattr(ev.as_reader(), member), _member_schema(log, member), member)
  assert n >= 3


def test_car_params_raw_bytes_both_ways():
  cp = car.CarParams.new_message()
  _fill(cp, car.CarParams.schema)
  cp.longitudinalActuatorDelay = 0.45
  with ref_car.CarParams.from_bytes(cp.to_bytes()) as r:
    assert r.longitudinalActuatorDelay == pytest.approx(0.45) and r.carFingerprint == cp.carFingerprint
    _compare(cp.as_reader(), r, car.CarParams.schema, "CarParams")
  rcp = ref_car.CarParams.new_message(carFingerprint="TOYOTA_COROLLA_TSS2", steerRatio=13.9)
  rcp.lateralTuning.init("torque").friction = 0.1  # a union member we only hold as a placeholder
  with car.CarParams.from_bytes(rcp.to_bytes()) as r:
    assert r.carFingerprint == "TOYOTA_COROLLA_TSS2" and r.steerRatio == pytest.approx(13.9)


def test_unknown_upstream_member_is_reported_not_misread():
  # a member we keep only as a placeholder decodes as that member, with its openpilot name
  ev = ref_log.Event.new_message()
  ev.init("controlsState").curvature = 0.5
  with log.Event.from_bytes(ev.to_bytes()) as r:
    assert r.which() == "controlsState"


def test_enums_match_by_value():
  assert dict(log.FrameData.ImageSensor.schema.enumerants) == dict(ref_log.FrameData.ImageSensor.schema.enumerants)
  assert dict(log.InitData.DeviceType.schema.enumerants) == dict(ref_log.InitData.DeviceType.schema.enumerants)
  assert dict(log.EncodeIndex.Type.schema.enumerants) == dict(ref_log.EncodeIndex.Type.schema.enumerants)
  ev = ref_log.Event.new_message()
  ev.init("deviceState").deviceType = "mici"
  with log.Event.from_bytes(ev.to_bytes()) as r:
    assert r.deviceState.deviceType == "mici"


def _run(code: str, env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
  env = {**os.environ, **env_extra}
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60,
                        cwd=str(Path(__file__).resolve().parents[1]))


def test_openpilot_cereal_is_preferred_when_importable(tmp_path):
  # a stand-in for openpilot's `cereal` package, serving the reference schema the way openpilot's __init__ does
  pkg = tmp_path / "cereal"
  pkg.mkdir()
  (pkg / "__init__.py").write_text(textwrap.dedent(f"""
    import capnp
    capnp.remove_import_hook()
    log = capnp.load({str(REF / 'log.capnp')!r})
    car = capnp.load({str(REF / 'car.capnp')!r})
  """))
  code = """
    from selfdrive_glue import schema, messaging
    ev = messaging.new_message('modelV2')
    print(schema.SOURCE, ev.schema.node.id == 0xd314cfd957229c11)
  """
  pp = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
  r = _run(code, {"PYTHONPATH": pp, "MODELD_CEREAL": "auto"}, tmp_path)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["openpilot", "True"]
  r = _run(code, {"PYTHONPATH": pp, "MODELD_CEREAL": "own"}, tmp_path)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["modeld-msm", "False"]


def test_bad_schema_choice_is_a_user_error(tmp_path):
  r = _run("import selfdrive_glue.schema", {"MODELD_CEREAL": "nope"}, tmp_path)
  assert r.returncode != 0 and "MODELD_CEREAL='nope' is not valid" in r.stderr


def test_also_compatible_with_april_2026_master():
  """The later upstream set (legacy.capnp -> deprecated.capnp, deprecated fields grouped) must read the same bytes."""
  master = REF_ROOT / "master-2026-04-15"
  if not (master / "log.capnp").exists():
    pytest.skip(f"no master reference set at {master}")
  code = """
    import test_schema_compat as t
    t.test_layout_matches_reference()
    for m in t.EVENT_MEMBERS:
      t.test_ours_to_reference(m)
      t.test_reference_to_ours(m)
    t.test_car_params_raw_bytes_both_ways()
    t.test_enums_match_by_value()
    print("compatible")
  """
  tests_dir = Path(__file__).resolve().parent
  pp = os.pathsep.join([str(tests_dir.parent), os.environ.get("PYTHONPATH", "")])
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "SCHEMA_REF_DIR": str(master), "PYTHONPATH": pp},
                     cwd=tests_dir, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.strip() == "compatible", r.stderr[-2000:]


def test_encode_index_from_reference_reads_as_ours():
  """The fields replay maps frames with, written by openpilot's schema (as loggerd does), read back through ours."""
  ev = ref_log.Event.new_message(logMonoTime=5)
  idx = ev.init("wideRoadEncodeIdx")
  idx.frameId, idx.type, idx.encodeId, idx.segmentNum, idx.segmentId, idx.segmentIdEncode = 1202, "fullHEVC", 4321, 3, 1199, 1199
  idx.timestampSof, idx.timestampEof = 10**12, 10**12 + 30_000_000
  with log.Event.from_bytes(ev.to_bytes()) as r:
    assert r.which() == "wideRoadEncodeIdx"
    w = r.wideRoadEncodeIdx
    assert (w.frameId, str(w.type), w.encodeId, w.segmentNum, w.segmentId, w.segmentIdEncode) == (1202, "fullHEVC", 4321, 3, 1199, 1199)
    assert (w.timestampSof, w.timestampEof) == (10**12, 10**12 + 30_000_000)
  init = ref_log.Event.new_message()
  d = init.init("initData")
  d.dongleId, d.deviceType, d.version, d.wallTimeNanos = "0123456789abcdef", "tizi", "0.11.0", 1_700_000_000 * 10**9
  d.init("androidProperties")  # a Map we hold only as a placeholder
  with log.Event.from_bytes(init.to_bytes()) as r:
    assert r.which() == "initData"
    assert (r.initData.dongleId, str(r.initData.deviceType), r.initData.version) == ("0123456789abcdef", "tizi", "0.11.0")
    assert r.initData.wallTimeNanos == 1_700_000_000 * 10**9
