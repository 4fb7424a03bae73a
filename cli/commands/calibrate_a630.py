"""`modeld-msm calibrate-a630 --artifact DIR -o calib.json`: every kernel of a QCOM artifact timed on its own by the GPU's
clock, and the a630 cost model's unsourced constants fitted to those times.

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


def _step(art):
  """(callable that runs one frame, the artifact's JITs) for its kind."""
  import numpy as np

  from selfdrive_glue.nv12 import nv12_info
  if art.spec.process == "dmonitoringmodeld":
    from modeld_msm.dm_core import DMonitoringCore
    core = DMonitoringCore(art)
    z = np.zeros(nv12_info(*core.camera).size, np.uint8)
    return (lambda: core.run(z)), [core.program.jit]
  from modeld_msm.model_state import ModelState
  ms = ModelState(art)
  z, eye = np.zeros(ms.nv12.size, np.uint8), np.eye(3, dtype=np.float32)
  at = np.array([[0.2, 0.3]], np.float32)
  jits = [p.jit for p in (ms.warp, ms.step) if p is not None]
  return (lambda: ms.run(z, z, eye, eye, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), False, action_t=at)), jits


def _read_json(path: str, what: str) -> dict:
  try:
    data = json.loads(Path(path).read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"{path}: not {what} ({e})") from None
  if not isinstance(data, dict):
    raise UserError(f"{path}: not {what} (expected a JSON object)")
  return data


def _device_timings(path: str) -> list[dict]:
  d = _read_json(path, "a calibration written by calibrate-a630")
  ks = d.get("kernels")
  if d.get("format") != FORMAT or not isinstance(ks, list) or not ks:
    raise UserError(f"{path}: not a calibration written by calibrate-a630 (format '{FORMAT}' with a kernel list)")
  for k in ks:
    if not isinstance(k, dict) or not isinstance(k.get("kernel"), str) or not isinstance(k.get("measured_us"), (int, float)) \
       or not k["measured_us"] > 0:
      raise UserError(f"{path}: kernel entry {k!r} needs a name and a measured_us > 0")
  return ks


def run(args) -> int:
  from backend import a630_cost as ac
  device_rows = _device_timings(args.timings) if args.timings else None
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
  step()
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
  if all(t.work is not None for t in times):
    fitted, res = fit_kernels(times)
    out["constants"] = ac.constants_dict(fitted)
    out["residuals"] = [{"kernel": k, "measured_us": round(m, 3), "fitted_us": round(f, 3)} for k, m, f in res]
    worst = max(abs(f - m) / m for _, m, f in res)
    print(f"{len(times)} kernel launches timed; fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in out["constants"].items()))
    print(f"residuals: worst {100 * worst:.1f} %, frame {sum(m for _, m, _ in res) / 1e3:.2f} ms measured vs "
          f"{sum(f for _, _, f in res) / 1e3:.2f} ms fitted")
  else:
    print(f"{len(times)} kernel launches timed ({sum(t.measured_us for t in times) / 1e3:.2f} ms one after another); no emulator here: "
          f"send {args.output} back and fit it with `modeld-msm calibrate-a630 --artifact DIR --timings {args.output} -o fitted.json`")
  from selfdrive_glue.files import write_atomic
  write_atomic(args.output, json.dumps(out, indent=1))
  return 0
