"""`modeld-msm calibrate-a630 --artifact DIR -o calib.json`: every kernel of a QCOM artifact timed on its own by the GPU's
clock, and the a630 cost model's unsourced constants fitted to those times; then whole frames as served, with the waits
for idle kept and with the independent ones dropped, their outputs compared byte for byte.

On a comma device (MODELD_DEV=MSM+QCOM:IR3, or KGSL+QCOM) the times are the GPU's always-on counter around each dispatch;
the device has no emulator, so calib.json holds the times alone: bring it back and run `calibrate-a630 --artifact DIR
--timings calib.json -o fitted.json` on a build machine, which executes the same kernels on the emulated render node for
their work counts and fits. On the emulated node (MODELD_DEV=EMU+QCOM:IR3) both happen in one run, the times being the
cost model's own (under --emu-constants), so the fit must give those constants back.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError

FORMAT = "modeld-msm a630 calibration 1"


def add_arguments(p) -> None:
  p.add_argument("--artifact", required=True, help="a QCOM artifact directory (any kind)")
  p.add_argument("-o", "--output", required=True, help="where to write the calibration (JSON)")
  p.add_argument("--repeat", type=integer(1), default=5, help="runs per kernel on a device; the fastest counts (default 5)")
  p.add_argument("--timings", help="a calibration written on a device: fit its times here (needs the emulated render node)")
  p.add_argument("--emu-constants", help="on the emulated node: JSON of cost-model constants its timings follow (default: the shipped ones)")
  p.add_argument("--plot", help="draw the fit and the frames into this PNG (where the fit is: the emulated node or --timings; matplotlib)")
  p.add_argument("--frames", type=integer(0), help="whole frames timed as served, with the waits for idle kept and with the "
                 f"independent ones dropped (default {DEVICE_FRAMES} on a device, {EMU_FRAMES} on the emulated node; 0: none)")


DEVICE_FRAMES, EMU_FRAMES = 20, 2


def _step(art):
  """(callable that runs frame i of seeded camera bytes, the artifact's JITs) for its kind; frame i's raw outputs."""
  import numpy as np

  from selfdrive_glue.nv12 import nv12_info

  def nv12(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
  if art.spec.process == "dmonitoringmodeld":
    from modeld_msm.dm_core import DMonitoringCore
    core = DMonitoringCore(art)
    size = nv12_info(*core.camera).size
    return (lambda i: core.run(nv12(i, size))), [core.program.jit]
  from modeld_msm.model_state import ModelState
  ms = ModelState(art)
  eye = np.eye(3, dtype=np.float32)
  at = np.array([[0.2, 0.3]], np.float32)
  jits = [p.jit for p in (ms.warp, ms.step) if p is not None]

  def frame(i: int) -> np.ndarray:
    buf = nv12(i, ms.nv12.size)
    return ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), False, action_t=at)[1]
  return frame, jits


def _read_json(path: str, what: str) -> dict:
  try:
    data = json.loads(Path(path).read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"{path}: not {what} ({e})") from None
  if not isinstance(data, dict):
    raise UserError(f"{path}: not {what} (expected a JSON object)")
  return data


def _device_timings(path: str) -> dict:
  d = _read_json(path, "a calibration written by calibrate-a630")
  ks = d.get("kernels")
  if d.get("format") != FORMAT or not isinstance(ks, list) or not ks:
    raise UserError(f"{path}: not a calibration written by calibrate-a630 (format '{FORMAT}' with a kernel list)")
  for k in ks:
    if not isinstance(k, dict) or not isinstance(k.get("kernel"), str) or not isinstance(k.get("measured_us"), (int, float)) \
       or not k["measured_us"] > 0:
      raise UserError(f"{path}: kernel entry {k!r} needs a name and a measured_us > 0")
  if "frames" in d and not _frames_ok(d["frames"]):
    raise UserError(f"{path}: 'frames' needs each leg's frame times (ms > 0), as calibrate-a630 writes them")
  return d


def _frames_ok(f: Any) -> bool:
  def times(leg: Any) -> bool:
    ms = leg.get("ms") if isinstance(leg, dict) else None
    return isinstance(ms, list) and bool(ms) and all(isinstance(x, (int, float)) and x > 0 for x in ms)
  if not isinstance(f, dict) or not times(f.get("waits_kept")):
    return False
  b = f.get("independent_waits_dropped")
  return b is None or (isinstance(b, dict) and ("ms" not in b or times(b)))


def _summary(ms: list[float]) -> dict:
  import statistics
  return {"ms": [round(x, 3) for x in ms], "median_ms": round(statistics.median(ms), 3), "min_ms": round(min(ms), 3)}


def _frames(art, device: str, n: int, emu_c, dispatches: int) -> dict:
  """Whole frames as served, from two fresh loads of the artifact (the same recurrent state at the start), one with every
  wait for idle kept and one with the independent ones dropped (MSM_INDEPENDENT_NO_WFI=1, docs/a630-time.md "Lever:
  wait-for-idle"), on the same inputs: their times and whether their outputs are the same bytes (a dispatch that raced
  one it depends on would change them)."""
  from tinygrad import Device

  from backend.a630_timing import time_frames
  from backend.qcom import NO_WFI_ENV
  dev: Any = Device[device]
  node = getattr(dev.iface, "node", None)
  kept_ms, kept_out = time_frames(_step(art)[0], device, n, emu_c)
  out: dict = {"clock": "cost model of the executed dispatches" if node is not None else "host wall clock, upload to outputs read back",
               "inputs": f"{n} frames of seeded random camera bytes", "dispatches": dispatches, "waits_kept": _summary(kept_ms)}
  stats = getattr(dev.iface, "stats", None)
  if stats is None:
    out["independent_waits_dropped"] = {"skipped": f"{type(dev.iface).__name__} keeps tinygrad's queue: the lever is the MSM interface's"}
    return out
  hazards = len(node.stats.order_hazards) if node is not None else 0
  os.environ[NO_WFI_ENV] = "1"   # read when a graph's queue is made: a second load of the artifact gets its own
  try:
    step_b, _ = _step(art)
    dropped = stats["waits_dropped"]   # from here: the graphs a frame runs (the load binds the warp-only one of dropped frames)
    ms, outs = time_frames(step_b, device, n, emu_c)
  finally:
    os.environ[NO_WFI_ENV] = "0"
  diff = next((i for i, (a, b) in enumerate(zip(kept_out, outs)) if a != b), None)
  races = [] if node is None else list(node.stats.order_hazards[hazards:])
  out["independent_waits_dropped"] = {**_summary(ms), "waits_dropped": stats["waits_dropped"] - dropped, "identical_outputs": diff is None,
                                      "first_different_frame": diff, "order_hazards": None if node is None else races,
                                      "safe": diff is None and not races}
  return out


def _frames_lines(f: dict, kernels_ms: float, model_ms: float | None) -> list[str]:
  """What the frames say, from the times alone (a device's file is read back on the build machine)."""
  from statistics import median
  kept, b = f["waits_kept"]["ms"], f.get("independent_waits_dropped") or {}
  fitted = "" if model_ms is None else f", the fitted model's frame {model_ms:.2f} ms"
  lines = [f"frames as served ({f.get('clock', '?')}): median {median(kept):.2f} ms, fastest {min(kept):.2f} over {len(kept)}; "
           f"the kernels alone add up to {kernels_ms:.2f} ms{fitted}"]
  if "ms" in b:
    verdict = (f"outputs identical over {len(b['ms'])} frames" if b.get("identical_outputs") else
               f"OUTPUTS DIFFER from frame {b.get('first_different_frame')} on")
    if b.get("order_hazards"):
      verdict += f"; the emulator saw dispatches race one they depend on ({b['order_hazards'][0]})"
    if not b.get("safe"):
      verdict += ": leave MSM_INDEPENDENT_NO_WFI off"
    lines.append(f"independent waits for idle dropped ({b.get('waits_dropped', '?')} of {f.get('dispatches', '?')}): median "
                 f"{median(b['ms']):.2f} ms ({median(b['ms']) - median(kept):+.2f}), {verdict}")
  elif "skipped" in b:
    lines.append(f"independent waits for idle: not tried ({b['skipped']})")
  return lines


def run(args) -> int:
  from backend import a630_cost as ac
  from backend.qcom import NO_WFI_ENV
  if args.plot:
    try:
      import matplotlib  # noqa: F401
    except ModuleNotFoundError:
      raise UserError("--plot needs matplotlib (pip install -e .[replay])") from None
  device = _device_timings(args.timings) if args.timings else None
  device_rows = device["kernels"] if device is not None else None
  os.environ[NO_WFI_ENV] = "0"   # the artifact as modeld runs it by default; _frames loads it again with the lever on
  emu_c = ac.DEFAULT
  if args.emu_constants:
    try:
      emu_c = ac.constants_from(_read_json(args.emu_constants, "cost-model constants"))
    except (ValueError, TypeError) as e:
      raise UserError(f"{args.emu_constants}: {e}") from None
  if device_rows is not None:
    os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"   # the work counts come from the emulated node
  from artifact.format import verify_artifact
  art = verify_artifact(args.artifact, device="QCOM")
  step, jits = _step(art)
  from tinygrad import Device

  from backend.a630_timing import Recorder, fit_kernels, time_kernels
  recs = [Recorder(j) for j in jits]
  step(0)
  dev: Any = Device[Device.DEFAULT]
  emulated = getattr(dev.iface, "node", None) is not None
  if device_rows is not None and not emulated:
    raise UserError("--timings needs the emulated render node (MODELD_DEV=EMU+QCOM:IR3 and tinymesa): run it on a build machine")
  from compile.tuning.qcom_tiles import calibration_launches
  # the big image convolutions at two or three register-tile sizes: their compiled variants ship with the tile table
  times = time_kernels(recs, Device.DEFAULT, args.repeat, emu_c, variants=calibration_launches())
  if device_rows is not None:
    if [r["kernel"] for r in device_rows] != [t.kernel for t in times]:
      raise UserError(f"{args.timings}: its kernels are not this artifact's ({len(device_rows)} vs {len(times)} launches, or other names)")
    from dataclasses import replace
    times = [replace(t, measured_us=float(r["measured_us"])) for t, r in zip(times, device_rows)]
  out: dict = {"format": FORMAT, "artifact": str(art.path), "kind": art.kind, "device": type(dev.iface).__name__,
               "clock": "cost model of executed work (emulated node)" if emulated and device_rows is None else "GPU always-on counter (19.2 MHz)",
               "repeat": args.repeat, "kernels": [], "constants": None, "shipped": ac.constants_dict(ac.DEFAULT), "residuals": []}
  for t in times:
    out["kernels"].append({"index": t.index, "kernel": t.kernel, "global": list(t.global_size), "local": list(t.local_size),
                           "measured_us": round(t.measured_us, 3), "variant_of": t.variant_of, "opts": t.opts,
                           "work": None if t.work is None else {k: getattr(t.work, k) for k in ("alu", "sfu", "tex", "nbytes", "fibers", "groups",
                                                                                                 "group_size", "regs")}})
  out["tiles"] = [{"kernel": times[i].kernel, "measured_us": round(times[i].measured_us, 3),
                   "variants": [{"kernel": t.kernel, "opts": t.opts, "measured_us": round(t.measured_us, 3)} for t in times if t.variant_of == i]}
                  for i in sorted({t.variant_of for t in times if t.variant_of is not None})]
  if out["tiles"]:
    print(f"register tiles: {len(out['tiles'])} big image convolutions also timed at "
          f"{', '.join(str(1 + len(r['variants'])) for r in out['tiles'])} tile sizes")
  base = [t for t in times if t.variant_of is None]   # the frame's own launches
  if device is not None:
    frames = device.get("frames")
  else:
    n = args.frames if args.frames is not None else EMU_FRAMES if emulated else DEVICE_FRAMES
    del step, jits, recs   # its buffers: the frames load the artifact afresh
    frames = _frames(art, Device.DEFAULT, n, emu_c, len(base)) if n else None
  model_ms = None
  if all(t.work is not None for t in times):
    fitted, res = fit_kernels(times)
    out["constants"] = ac.constants_dict(fitted)
    # every launch has its work and a time > 0 here, so the residuals are the launches' own, in order
    out["residuals"] = [{"index": t.index, "kernel": k, "measured_us": round(m, 3), "fitted_us": round(f, 3), "variant_of": t.variant_of}
                        for t, (k, m, f) in zip(times, res, strict=True)]
    worst = max(abs(f - m) / m for _, m, f in res)
    model_ms = ac.frame_us([t.work for t in base if t.work is not None], fitted) / 1e3
    print(f"{len(times)} kernel launches timed; fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in out["constants"].items()))
    print(f"residuals: worst {100 * worst:.1f} %, all launches {sum(m for _, m, _ in res) / 1e3:.2f} ms measured vs "
          f"{sum(f for _, _, f in res) / 1e3:.2f} ms fitted")
  else:
    print(f"{len(times)} kernel launches timed ({sum(t.measured_us for t in times) / 1e3:.2f} ms one after another); no emulator here: "
          f"send {args.output} back and fit it with `modeld-msm calibrate-a630 --artifact DIR --timings {args.output} -o fitted.json`")
  if frames:
    kernels_ms = sum(t.measured_us for t in base) / 1e3
    out["frames"] = {**frames, "kernels_alone_ms": round(kernels_ms, 3), "model_ms": None if model_ms is None else round(model_ms, 3)}
    for line in _frames_lines(frames, kernels_ms, model_ms):
      print(line)
  from selfdrive_glue.files import write_atomic
  write_atomic(args.output, json.dumps(out, indent=1))
  if args.plot and out["residuals"]:
    from offcar.calib_plot import plot_calibration
    plot_calibration(out, Path(args.plot))
    print(f"plot: {args.plot}")
  elif args.plot:
    print(f"no fit here, so no plot: fit {args.output} with --timings on a build machine and --plot there")
  return 0
