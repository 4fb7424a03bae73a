"""`modeld-msm calibrate-a630`: every kernel of a QCOM artifact timed alone and the cost model fitted, end to end on the
emulated render node (its times are the model's under planted constants, so the fit must find them again), and the
device's two-step path (times from the car, work counts and fit on a build machine)."""
import json

import pytest

from backend import a630_cost as ac

pytestmark = pytest.mark.xdist_group("qcom_artifact")
EMU = {"MODELD_DEV": "EMU+QCOM:IR3"}
PLANTED = {"tex_rate": 9.0e9, "launch_us": 11.0, "dram_eff": 0.7, "issue_eff": 0.6}


@pytest.fixture(scope="module")
def planted_calib(qcom_artifact, cli, tmp_path_factory):
  d = tmp_path_factory.mktemp("calib")
  (d / "planted.json").write_text(json.dumps(PLANTED))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "-o", d / "calib.json", "--emu-constants", d / "planted.json", env=EMU)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "gpu fault" not in r.stdout + r.stderr   # every tile variant binds its buffers as the kernel it stands in for
  return d, json.loads((d / "calib.json").read_text())


def test_emulated_run_times_every_kernel_and_the_fit_finds_the_planted_constants(planted_calib):
  _, cal = planted_calib
  ks = cal["kernels"]
  assert cal["kind"] == "driving" and len(ks) > 10 and all(k["measured_us"] > 0 and k["work"] for k in ks)
  # every launch of the frame, repeats included, in order
  assert [k["index"] for k in ks] == list(range(len(ks))) and len({k["kernel"] for k in ks}) < len(ks)
  # the big image convolutions also at two or three register-tile sizes (the shipped tile set's compiled variants), on the
  # same buffers right after the launch they stand in for, each with its own work: the fit below includes them
  tiles = cal["tiles"]
  assert tiles and all(2 <= 1 + len(t["variants"]) <= 3 for t in tiles), tiles
  variants = [k for k in ks if k["variant_of"] is not None]
  assert len(variants) == sum(len(t["variants"]) for t in tiles)
  for k in variants:
    base = ks[k["variant_of"]]
    assert base["variant_of"] is None and k["kernel"] != base["kernel"] and k["opts"] and k["work"]["regs"] > 0
    assert k["work"]["tex"] != base["work"]["tex"]   # another tile fetches another number of texels
  got = cal["constants"]
  for name, v in PLANTED.items():
    assert got[name] == pytest.approx(v, rel=0.03), name
  assert all(abs(r["fitted_us"] - r["measured_us"]) <= 0.02 * r["measured_us"] for r in cal["residuals"])
  # the shipped constants would not have matched those times
  shipped = ac.constants_from(cal["shipped"])
  assert any(abs(ac.dispatch_us([ac.Work(k["kernel"], **k["work"])], shipped)[0] - k["measured_us"]) > 0.1 * k["measured_us"] for k in ks)


def test_times_from_a_device_are_fitted_on_the_build_machine(planted_calib, qcom_artifact, cli):
  d, cal = planted_calib
  # what a device writes: the times alone (no emulator on the car), here the planted model's times
  device = {**cal, "kernels": [{**k, "work": None, "measured_us": k["measured_us"]} for k in cal["kernels"]], "constants": None}
  (d / "device.json").write_text(json.dumps(device))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "--timings", d / "device.json", "-o", d / "fitted.json")
  assert r.returncode == 0, r.stdout + r.stderr
  fitted = json.loads((d / "fitted.json").read_text())
  assert [k["measured_us"] for k in fitted["kernels"]] == [k["measured_us"] for k in cal["kernels"]]
  assert fitted["constants"]["tex_rate"] == pytest.approx(PLANTED["tex_rate"], rel=0.03)
  # a device file from another artifact is refused, in one line, with nothing written
  (d / "other.json").write_text(json.dumps({**device, "kernels": device["kernels"][:-1]}))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "--timings", d / "other.json", "-o", d / "no.json")
  assert r.returncode == 2 and "not this artifact's" in r.stderr and len(r.stderr.strip().splitlines()) == 1
  assert not (d / "no.json").exists()


@pytest.mark.parametrize("case", ["no artifact", "cpu artifact", "bad timings", "bad constants"])
def test_bad_input_is_one_line_and_exit_2(case, cli, tmp_path, cpu_artifact_1928, qcom_artifact):
  art = {"no artifact": tmp_path / "missing", "cpu artifact": cpu_artifact_1928}.get(case, qcom_artifact)
  extra = []
  if case == "bad timings":
    (tmp_path / "t.json").write_text('{"format": "something else"}')
    extra = ["--timings", tmp_path / "t.json"]
  if case == "bad constants":
    (tmp_path / "c.json").write_text('{"tex_rte": 1}')
    extra = ["--emu-constants", tmp_path / "c.json"]
  r = cli("calibrate-a630", "--artifact", art, "-o", tmp_path / "out.json", *extra, env=EMU)
  assert r.returncode == 2, r.stdout + r.stderr
  assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
  assert not (tmp_path / "out.json").exists()
