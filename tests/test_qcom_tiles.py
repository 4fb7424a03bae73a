"""QCOM register tiles (compile/tuning/qcom_tiles.py): the search's choice rule, the shipped table's evidence, a QCOM
compile applying it (the tiny driving artifact every QCOM test shares), and the fallback to tinygrad's heuristic."""
import json
from dataclasses import asdict

import pytest

from backend import a630_cost as ac
from compile.capture import QCOM_FLAGS_OF
from compile.tuning import qcom_tiles as q
from selfdrive_glue.errors import UserError


def _variant(tex: float, regs: int, exact: bool, opts: list, sig: str = "data1:1:half") -> q.Variant:
  """A texture-bound kernel of plenty of waves: its time is its fetches, over the waves its registers leave resident."""
  w = ac.Work(f"k{len(opts)}_{tex:g}", 1e6, 0, tex, 0, 65536, 1024, 64, regs=regs)
  return q.Variant(opts, w.name, asdict(w), ac.dispatch_us([w])[0], exact, "" if exact else "outputs differ",
                   {"lib": "00", "name": w.name, "function_name": w.name, "groups": [1024, 1, 1], "local": [64, 1, 1], "sig": [sig]})


def test_the_search_chooses_a_tile_that_loses_nowhere_in_the_band_and_times_two_or_three_sizes():
  heur = _variant(10e6, 16, True, [["UPCAST", 0, 4]])
  wrong = _variant(1e6, 16, False, [["UPCAST", 0, 4], ["UNROLL", 0, 4]])
  # fastest under the shipped constants, but 2 resident waves: slower than the heuristic if 8 are needed to hide fetches
  greedy = _variant(4e6, 56, True, [["UPCAST", 0, 4], ["UPCAST", 1, 5]])
  bigger = _variant(6e6, 24, True, [["UPCAST", 0, 4], ["UPCAST", 1, 2]])
  biggest = _variant(5e6, 30, True, [["UPCAST", 0, 4], ["UPCAST", 1, 3]])
  smaller = _variant(20e6, 10, True, [])
  other_binding = _variant(3.5e6, 64, True, [["UPCAST", 0, 4], ["UPCAST", 3, 4]], sig="data1:1:image")
  f = q.Searched("ab", "k", 1, [heur, wrong, greedy, bigger, biggest, smaller, other_binding])
  assert greedy.us < bigger.us and f.best() is bigger   # outputs that differ never win; a tile that could lose neither
  # calibrate-a630 times the heuristic's tile, the chosen one and the largest tried (fewest fetches) of those that bind
  # the buffers as the chosen one does (one reading a buffer through a texture instead would fault in its place)
  assert q.calibration_variants(f) == [heur, bigger, greedy]
  # where the heuristic is the best, the other size is the one with the fewest fetches, here a smaller one's
  f2 = q.Searched("cd", "k", 1, [_variant(2e6, 16, True, [["UPCAST", 0, 4]]), smaller])
  assert q.calibration_variants(f2) == f2.variants


def test_the_shipped_sets_carry_their_evidence():
  table = q.load_table(q.TABLE)
  assert table["sets"], "no shipped register-tile set"
  for s in table["sets"]:
    assert s["match"]["device"] == "QCOM" and s["match"]["tinygrad"] and s["match"]["models"]
    for e in s["entries"]:
      vs = e["variants"]
      heur, chosen = vs[0], next(v for v in vs if v["opts"] == e["opts"])
      assert heur["name"] == e["heuristic"] and heur["bit_exact"]
      # the choice is bit-exact with the heuristic kernel on its seeded inputs and no slower under the shipped constants
      assert chosen["bit_exact"] and chosen["us"] <= heur["us"] and chosen["name"] == e["name"]
      assert q.Searched(e["ast"], e["heuristic"], e["macs"], [q.Variant(**{**v, "launch": None}) for v in vs]).best().opts == e["opts"]
      # the tiles calibrate-a630 times in place of the chosen kernel: they bind its buffers the same way
      cal = e["calibration"]
      assert any(c["opts"] == e["opts"] for c in cal) and all(c["lib"] and c["groups"] and c["sig"] == cal[0]["sig"] for c in cal)


def test_the_dm_set_holds_its_stem_normalisation_on_a_tile_that_does_not_spill():
  """The big elementwise kernels over images are searched too: the DM's stem normalisation (Elu and fp16 image write in
  one kernel) spills registers to private memory at the heuristic's tile; the chosen tile holds fewer and moves half the
  bytes (chosen bit-exact, as every entry: test_the_shipped_sets_carry_their_evidence)."""
  dm = next(s for s in q.load_table(q.TABLE)["sets"] if s["size"] == "full" and s["match"]["kind"] == "dmonitoring")
  elementwise = [e for e in dm["entries"] if e["macs"] == 0]
  e = next(e for e in elementwise if e["heuristic"] == "E_240_90_4_4_4")
  heur, chosen = e["variants"][0]["work"], next(v for v in e["variants"] if v["opts"] == e["opts"])["work"]
  assert chosen["regs"] < heur["regs"] and chosen["nbytes"] < 0.6 * heur["nbytes"], (heur, chosen)


pytestmark_artifact = pytest.mark.xdist_group("qcom_artifact")


@pytest.mark.slow
def test_a_camera_no_set_was_recorded_for_gets_the_tiles_of_its_model_kernels(tiny_models, tmp_path, cli):
  """The tiny set was recorded at 1928x1208; at 1344x760 only the warp's kernels differ, so the model's big kernels find
  their tiles by AST (and the compile's bit-exact checks pass with them)."""
  r = cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
          "--camera", "1344x760", "--device", "QCOM", "-o", tmp_path / "a")
  assert r.returncode == 0, r.stdout + r.stderr
  meta = json.loads((tmp_path / "a" / "metadata.json").read_text())
  entries = next(s for s in q.load_table(q.TABLE)["sets"] if s["size"] == "tiny" and s["match"]["kind"] == "driving")["entries"]
  tiles = meta["qcom_tiles"]
  # the tiny set's kernels and more: the full driving set holds two elementwise kernels over the vision model's input
  # image, which is the same at any model size
  assert tiles["used"] and tiles["kernels"] > len(entries) and tiles["misses"] == 0 and "matched by AST" in tiles["why"], tiles
  for e in (e for e in entries if e["name"] != e["heuristic"]):
    assert e["name"] in meta["kernel_us"] and e["heuristic"] not in meta["kernel_us"], e["name"]


@pytestmark_artifact
def test_a_qcom_compile_applies_the_shipped_tiles_and_its_checks_pass(qcom_artifact):
  meta = json.loads((qcom_artifact / "metadata.json").read_text())
  tiles = meta["qcom_tiles"]
  entries = next(s for s in q.load_table(q.TABLE)["sets"] if s["size"] == "tiny" and s["match"]["kind"] == "driving")["entries"]
  assert tiles["used"] and tiles["kernels"] > len(entries) and tiles["misses"] == 0, tiles   # and two of the full set's
  changed = [e for e in entries if e["name"] != e["heuristic"]]
  assert changed, "the tiny set changes no kernel: the test would prove nothing"
  for e in changed:   # the artifact runs the chosen kernels, not the heuristic's
    assert e["name"] in meta["kernel_us"] and e["heuristic"] not in meta["kernel_us"], e["name"]
  checks = {c: (r, d) for c, r, d in meta["validation"]["checks"]}
  assert checks["jit == unjitted"][0] == "ok" and checks["pickle replay (EMU)"][0] == "ok"
  assert "from the shipped set" in checks["register tiles"][1]


def test_other_models_look_their_kernels_up_by_ast_other_builds_and_devices_keep_the_heuristic(monkeypatch):
  flags = QCOM_FLAGS_OF["0.11"]
  table = q.load_table(q.TABLE)
  t = q.choose("QCOM", "driving", (1344, 760), {"vision": "0" * 64, "policy": "0" * 64}, flags)
  # every set of this build (0.11's flags: not the master kinds') is searched by AST; the answer names them, and before
  # any kernel matched says heuristic
  assert set(t.entries) == {e["ast"] for s in table["sets"] if s["match"]["flags"] == flags for e in s["entries"]}
  assert {s["match"]["kind"] for s in table["sets"] if s["match"]["flags"] == flags} == {"driving", "dmonitoring"}
  assert "matched by AST" in t.why and "the full dmonitoring models at 1928x1208" in t.why
  assert t.summary() == "tinygrad's heuristic opts (no shipped register-tile set holds these kernels)"
  other = q.choose("QCOM", "driving", (1928, 1208), {}, {**flags, "FLOAT16": 0})
  assert other.recorded is None and "no shipped register-tile set for this tinygrad" in other.summary()
  assert q.choose("CPU", "driving", (1928, 1208), {}, {}).summary().startswith("tinygrad's heuristic opts")
  monkeypatch.setenv(q.MODE_ENV, "off")
  assert "=off" in q.choose("QCOM", "driving", (1928, 1208), {}, flags).summary()
  monkeypatch.setenv(q.MODE_ENV, "fast")
  with pytest.raises(UserError, match="use auto or off"):
    q.choose("QCOM", "driving", (1928, 1208), {}, flags)


def test_the_hook_stands_in_for_beam_search_only_while_capturing():
  from tinygrad.codegen.opt import search
  from tinygrad.helpers import BEAM
  kept = search.beam_search
  t = q.Tiles({"entries": [], "min_macs": 5}, "test")
  with t.hooked():
    assert search.beam_search is t and BEAM.value == 1
  assert search.beam_search is kept and BEAM.value == 0
  with q.Tiles(None, "none").hooked():   # nothing to apply: tinygrad untouched
    assert search.beam_search is kept


def test_a_broken_table_is_refused_in_one_line(tmp_path, monkeypatch):
  bad = tmp_path / "t.json"
  bad.write_text('{"format": 99, "sets": []}')
  monkeypatch.setenv(q.TABLE_ENV, str(bad))
  with pytest.raises(UserError, match="record it again"):
    q.load_table()
  bad.write_text("{not json")
  with pytest.raises(UserError, match="not a QCOM register-tile table"):
    q.load_table()


def test_the_shipped_table_is_pinned_and_an_edited_copy_refused(tmp_path, monkeypatch):
  """calibrate-a630 runs the IR3 binaries the table holds on a device: a table that is not the one recorded is refused."""
  import hashlib
  copy = tmp_path / q.TABLE.name
  data = q.TABLE.read_bytes()
  assert hashlib.sha256(data).hexdigest() == q.TABLE_SHA256
  copy.write_bytes(data)
  monkeypatch.setattr(q, "TABLE", copy)
  assert q.load_table()["sets"]
  copy.write_bytes(data.replace(b'"recorded"', b'"recorded "', 1))
  with pytest.raises(UserError, match=r"qcom_tiles_table.json does not match the sha256 recorded in tuning/qcom_tiles.py; record it again"):
    q.load_table()


def test_pinned_write_records_the_tables_sha256_in_its_source(tmp_path):
  from compile import pinned
  src, table = tmp_path / "reader.py", tmp_path / "t.json"
  src.write_text('X = 1\nTABLE_SHA256: str | None = None\nY = 2\n')
  sha = pinned.write(table, b'{"a": 1}\n', src)
  assert table.read_bytes() == b'{"a": 1}\n' and src.read_text() == f'X = 1\nTABLE_SHA256: str | None = "{sha}"\nY = 2\n'
  pinned.check(table, table.read_bytes(), sha, src, "fix")
  with pytest.raises(UserError, match="t.json does not match the sha256 recorded in .*/reader.py; fix"):
    pinned.check(table, b'{"a": 2}\n', sha, src, "fix")
  (tmp_path / "no_pin.py").write_text("X = 1\n")
  with pytest.raises(RuntimeError, match="TABLE_SHA256 line not found"):
    pinned.write(table, b"{}", tmp_path / "no_pin.py")
