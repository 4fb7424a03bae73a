"""`modeld-msm calibrate-a630`: every kernel of a QCOM artifact timed alone and the cost model fitted, end to end on the
emulated render node (its times are the model's under planted constants, so the fit must find them again), whole frames
with the waits for idle kept and with the independent ones dropped, and the device's two-step path (times from the car,
work counts and fit on a build machine)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, clone_artifact

from backend import a630_cost as ac

pytestmark = pytest.mark.xdist_group("qcom_artifact")
EMU = {"MODELD_DEV": "EMU+QCOM:IR3"}
PLANTED = {"tex_rate": 9.0e9, "launch_us": 11.0, "dram_eff": 0.7, "issue_eff": 0.6}


@pytest.fixture(scope="module")
def planted_calib(qcom_artifact, cli, tmp_path_factory):
  d = tmp_path_factory.mktemp("calib")
  (d / "planted.json").write_text(json.dumps(PLANTED))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "-o", d / "calib.json", "--emu-constants", d / "planted.json",
          "--plot", d / "calib.png", env=EMU)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "gpu fault" not in r.stdout + r.stderr   # every tile variant binds its buffers as the kernel it stands in for
  cal = json.loads((d / "calib.json").read_text())
  assert len(cal["artifacts"]) == 1 and cal["artifacts"][0]["artifact"] == "."   # a lone artifact, not a bundle
  return d, cal


def test_emulated_run_times_every_kernel_and_the_fit_finds_the_planted_constants(planted_calib):
  _, cal = planted_calib
  art = cal["artifacts"][0]
  ks = art["kernels"]
  assert art["kind"] == "driving" and art["camera"] == "1928x1208" and len(ks) > 10 and all(k["measured_us"] > 0 and k["work"] for k in ks)
  # every launch of the frame, repeats included, in order
  assert [k["index"] for k in ks] == list(range(len(ks))) and len({k["kernel"] for k in ks}) < len(ks)
  # the big image convolutions also at two or three register-tile sizes (the shipped tile set's compiled variants), on the
  # same buffers right after the launch they stand in for, each with its own work: the fit below includes them
  tiles = art["tiles"]
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
  assert all(abs(r["fitted_us"] - r["measured_us"]) <= 0.02 * r["measured_us"] for r in art["residuals"])
  # the shipped constants would not have matched those times
  shipped = ac.constants_from(cal["shipped"])
  assert any(abs(ac.dispatch_us([ac.Work(k["kernel"], **k["work"])], shipped)[0] - k["measured_us"]) > 0.1 * k["measured_us"] for k in ks)


def test_whole_frames_add_up_to_their_kernels_and_dropping_independent_waits_changes_no_output(planted_calib):
  _, cal = planted_calib
  art = cal["artifacts"][0]
  f, base = art["frames"], [k for k in art["kernels"] if k["variant_of"] is None]
  # a frame as served (its graphs, chunked submits) runs the launches that were timed alone, each once, with the same work
  assert f["dispatches"] == len(base) and len(f["waits_kept"]["ms"]) == 2
  assert f["kernels_alone_ms"] == pytest.approx(sum(k["measured_us"] for k in base) / 1e3, abs=2e-3)
  assert all(ms == pytest.approx(f["kernels_alone_ms"], rel=1e-3) for ms in f["waits_kept"]["ms"])
  assert f["model_ms"] == pytest.approx(f["kernels_alone_ms"], rel=0.02)   # the fit found the planted constants
  b = f["independent_waits_dropped"]
  assert 0 < b["waits_dropped"] < f["dispatches"] and b["identical_outputs"] and b["order_hazards"] == [] and b["safe"]


def test_the_fit_and_the_frames_are_drawn(planted_calib):
  import matplotlib.image
  d, cal = planted_calib
  art = cal["artifacts"][0]
  # one panel of each launch's measured against fitted time (the residuals name their launch and whether it is a variant),
  # one of the frames
  assert [r["index"] for r in art["residuals"]] == [k["index"] for k in art["kernels"]]
  assert [r["variant_of"] for r in art["residuals"]] == [k["variant_of"] for k in art["kernels"]]
  img = matplotlib.image.imread(d / "calib.png")
  assert img.shape[1] == 960 and img.shape[0] == 440 and img.std() > 0.05


PLANTED_RACE = """
import sys
from backend import qcom
qcom.Access.conflicts = lambda self, other: False   # every dispatch taken as independent: kernels read unfinished work
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dropped_wait_a_dispatch_depends_on_is_reported_unsafe(qcom_artifact, tmp_path):
  r = subprocess.run([sys.executable, "-c", PLANTED_RACE, "calibrate-a630", "--artifact", str(qcom_artifact), "-o", str(tmp_path / "c.json"),
                      "--frames", "1"], capture_output=True, text=True, cwd=REPO, timeout=600,
                     env={**os.environ, **EMU})
  assert r.returncode == 0, r.stdout + r.stderr
  b = json.loads((tmp_path / "c.json").read_text())["artifacts"][0]["frames"]["independent_waits_dropped"]
  assert b["order_hazards"] and not b["safe"]
  assert "race" in r.stdout and "leave MSM_INDEPENDENT_NO_WFI off" in r.stdout


def as_device(cal: dict, slower: float = 1.3) -> dict:
  """What a device writes for the same launches: the times alone (no emulator on the car), here the planted model's, and
  frames by the host's clock, slower than their kernels alone; no fit."""
  arts = []
  for a in cal["artifacts"]:
    alone = a["frames"]["kernels_alone_ms"]
    kept = [slower * alone, (slower - 0.1) * alone]
    frames = {**{k: v for k, v in a["frames"].items() if k not in ("kernels_alone_ms", "model_ms")}, "clock": "host wall clock",
              "waits_kept": {"ms": kept},
              "independent_waits_dropped": {"ms": [x - 0.1 for x in kept], "waits_dropped": 30, "identical_outputs": True, "safe": True}}
    arts.append({**{k: v for k, v in a.items() if k != "residuals"}, "frames": frames,
                 "kernels": [{**k, "work": None} for k in a["kernels"]]})
  slow_clock = {"source": "/sys/class/devfreq/5000000.gpu", "cur_freq": 587000000, "min_freq": 257000000, "max_freq": 710000000,
                "governor": "simple_ondemand"}
  return {**cal, "constants": None, "artifacts": arts, "gpu_clock": {"before": slow_clock, "after": slow_clock}}


def test_times_from_a_device_are_fitted_on_the_build_machine(planted_calib, qcom_artifact, cli):
  d, cal = planted_calib
  device = as_device(cal)
  (d / "device.json").write_text(json.dumps(device))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "--timings", d / "device.json", "-o", d / "fitted.json", "--plot", d / "fitted.png")
  assert r.returncode == 0, r.stdout + r.stderr
  assert (d / "fitted.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the device's times drawn on the build machine
  fitted = json.loads((d / "fitted.json").read_text())
  got, want = fitted["artifacts"][0], cal["artifacts"][0]
  assert [k["measured_us"] for k in got["kernels"]] == [k["measured_us"] for k in want["kernels"]]
  assert fitted["constants"]["tex_rate"] == pytest.approx(PLANTED["tex_rate"], rel=0.03)
  # the device's frames come back beside what its kernels alone add up to and the fitted model's frame
  kept = device["artifacts"][0]["frames"]["waits_kept"]["ms"]
  assert got["frames"]["waits_kept"]["ms"] == kept and got["frames"]["kernels_alone_ms"] == want["frames"]["kernels_alone_ms"]
  assert got["frames"]["model_ms"] == pytest.approx(want["frames"]["kernels_alone_ms"], rel=0.02)
  assert f"median {sum(kept) / 2:.2f} ms" in r.stdout and "dropped (30 of" in r.stdout and "-0.10" in r.stdout
  # the clock the device ran at comes back too, and a run below the top clock says so
  assert fitted["gpu_clock"] == device["gpu_clock"] and "587 -> 587 MHz" in r.stdout and "below its top clock" in r.stdout
  # a device file from another artifact is refused, in one line, with nothing written
  other = {**device, "artifacts": [{**device["artifacts"][0], "kernels": device["artifacts"][0]["kernels"][:-1]}]}
  (d / "other.json").write_text(json.dumps(other))
  r = cli("calibrate-a630", "--artifact", qcom_artifact, "--timings", d / "other.json", "-o", d / "no.json")
  assert r.returncode == 2 and "not this artifact's" in r.stderr and len(r.stderr.strip().splitlines()) == 1
  assert not (d / "no.json").exists()


@pytest.mark.slow
def test_a_bundle_is_calibrated_in_one_run_and_fitted_across_its_artifacts(qcom_artifact, dm_model, cli, tmp_path):
  """What a device tester runs: the release bundle's driving and DM artifacts in one run, one file back; the build
  machine fits one set of constants to every launch of both."""
  bundle = tmp_path / "bundle"
  clone_artifact(qcom_artifact, bundle / "1928x1208")
  r = cli("compile", "--model", dm_model, "--camera", "1928x1208", "--device", "QCOM", "-o", bundle / "dmonitoring" / "1928x1208")
  assert r.returncode == 0, r.stdout + r.stderr
  (tmp_path / "planted.json").write_text(json.dumps(PLANTED))
  r = cli("calibrate-a630", "--artifact", bundle, "-o", tmp_path / "calib.json", "--emu-constants", tmp_path / "planted.json",
          "--frames", "1", env=EMU)
  assert r.returncode == 0, r.stdout + r.stderr
  cal = json.loads((tmp_path / "calib.json").read_text())
  assert [(a["artifact"], a["kind"]) for a in cal["artifacts"]] == [("1928x1208", "driving"), ("dmonitoring/1928x1208", "dmonitoring")]
  for a in cal["artifacts"]:
    assert a["frames"]["waits_kept"]["ms"][0] == pytest.approx(a["frames"]["kernels_alone_ms"], rel=1e-3)
    assert a["frames"]["independent_waits_dropped"]["safe"]
    assert f"{a['artifact']}: frames as served" in r.stdout
  assert cal["constants"]["tex_rate"] == pytest.approx(PLANTED["tex_rate"], rel=0.03)
  # the device's file of the whole bundle, fitted on the build machine: both artifacts matched by name, one fit
  (tmp_path / "device.json").write_text(json.dumps(as_device(cal)))
  r = cli("calibrate-a630", "--artifact", bundle, "--timings", tmp_path / "device.json", "-o", tmp_path / "fitted.json")
  assert r.returncode == 0, r.stdout + r.stderr
  fitted = json.loads((tmp_path / "fitted.json").read_text())
  assert fitted["constants"]["tex_rate"] == pytest.approx(PLANTED["tex_rate"], rel=0.03)
  assert [len(a["residuals"]) for a in fitted["artifacts"]] == [len(a["kernels"]) for a in cal["artifacts"]]
  # a device file of the bundle is not one of its artifact alone
  r = cli("calibrate-a630", "--artifact", bundle / "1928x1208", "--timings", tmp_path / "device.json", "-o", tmp_path / "no.json")
  assert r.returncode == 2 and "pass the artifact or bundle the device ran" in r.stderr and not (tmp_path / "no.json").exists()


def test_the_gpu_clock_is_read_from_msm_devfreq_or_kgsl(tmp_path):
  from offcar.a630_calibration import clock_line, gpu_clock
  assert gpu_clock(tmp_path) is None and "not readable" in clock_line(None, None)
  kgsl = tmp_path / "kgsl" / "class" / "kgsl" / "kgsl-3d0"
  (kgsl / "devfreq").mkdir(parents=True)
  for name, v in (("gpuclk", "710000000"), ("max_gpuclk", "710000000"), ("devfreq/governor", "msm-adreno-tz")):
    (kgsl / name).write_text(v + "\n")
  c = gpu_clock(tmp_path / "kgsl")
  assert (c["cur_freq"], c["max_freq"], c["governor"]) == (710000000, 710000000, "msm-adreno-tz")
  assert "710 -> 710 MHz" in clock_line(c, c) and "below" not in clock_line(c, c)
  # mainline msm: the GPU's devfreq device (a630 at 0x5000000), not another devfreq device of the SoC
  (tmp_path / "msm" / "class" / "devfreq" / "soc:qcom,cpu-bw").mkdir(parents=True)
  gpu = tmp_path / "msm" / "class" / "devfreq" / "5000000.gpu"
  gpu.mkdir()
  for name, v in (("cur_freq", "342000000"), ("min_freq", "257000000"), ("max_freq", "710000000"), ("governor", "simple_ondemand")):
    (gpu / name).write_text(v + "\n")
  c = gpu_clock(tmp_path / "msm")
  assert c["source"].endswith("5000000.gpu") and c["cur_freq"] == 342000000 and c["governor"] == "simple_ondemand"
  assert "below its top clock" in clock_line(c, c)


@pytest.mark.parametrize("case", ["no artifact", "cpu artifact", "bad timings", "bad frames", "bad constants"])
def test_bad_input_is_one_line_and_exit_2(case, cli, tmp_path, cpu_artifact_1928, qcom_artifact):
  art = {"no artifact": tmp_path / "missing", "cpu artifact": cpu_artifact_1928}.get(case, qcom_artifact)
  extra = []
  if case == "bad timings":
    (tmp_path / "t.json").write_text('{"format": "something else"}')
    extra = ["--timings", tmp_path / "t.json"]
  if case == "bad frames":
    kernels = [{"kernel": "k", "measured_us": 1.0}]
    (tmp_path / "t.json").write_text(json.dumps({"format": "modeld-msm a630 calibration 2", "artifacts": [
      {"artifact": ".", "kernels": kernels, "frames": {"waits_kept": {"ms": [12.0, -1]}}}]}))
    extra = ["--timings", tmp_path / "t.json"]
  if case == "bad constants":
    (tmp_path / "c.json").write_text('{"tex_rte": 1}')
    extra = ["--emu-constants", tmp_path / "c.json"]
  r = cli("calibrate-a630", "--artifact", art, "-o", tmp_path / "out.json", *extra, env=EMU)
  assert r.returncode == 2, r.stdout + r.stderr
  assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
  assert case != "bad frames" or "'frames' needs each leg's frame times" in r.stderr
  assert not (tmp_path / "out.json").exists()
