"""`modeld-msm calibrate-a630 --artifact DIR -o calib.json`: every kernel of a QCOM artifact, or of each artifact of a
release bundle, timed on its own by the GPU's clock, and the a630 cost model's unsourced constants fitted to all those
times at once; then whole frames as served, with the waits for idle kept and with the independent ones dropped, their
outputs compared byte for byte (offcar/a630_calibration.py).

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


def add_arguments(p) -> None:
  from offcar.a630_calibration import DEVICE_FRAMES, EMU_FRAMES
  p.add_argument("--artifact", required=True, help="a QCOM artifact directory (any kind), or a release bundle: each of its artifacts")
  p.add_argument("-o", "--output", required=True, help="where to write the calibration (JSON)")
  p.add_argument("--repeat", type=integer(1), default=5, help="runs per kernel on a device; the fastest counts (default 5)")
  p.add_argument("--timings", help="a calibration written on a device: fit its times here (needs the emulated render node)")
  p.add_argument("--emu-constants", help="on the emulated node: JSON of cost-model constants its timings follow (default: the shipped ones)")
  p.add_argument("--plot", help="draw the fit and the frames into this PNG (where the fit is: the emulated node or --timings; matplotlib)")
  p.add_argument("--frames", type=integer(0), help="whole frames timed as served, with the waits for idle kept and with the "
                 f"independent ones dropped (default {DEVICE_FRAMES} on a device, {EMU_FRAMES} on the emulated node; 0: none)")


def _names(root: Path, dirs: list[Path]) -> list[str]:
  """Each artifact's name within what was calibrated ("." for a lone artifact): how a device's file is matched to them."""
  return [str(d.relative_to(root)) if d != root else "." for d in dirs]


def run(args) -> int:
  from artifact.format import artifact_dirs
  from backend import a630_cost as ac
  from offcar import a630_calibration as cal
  if args.plot:
    try:
      import matplotlib  # noqa: F401
    except ModuleNotFoundError:
      raise UserError("--plot needs matplotlib (pip install -e .[replay])") from None
  device, device_clock = cal.read_device_file(args.timings) if args.timings else (None, None)
  emu_c = ac.DEFAULT
  if args.emu_constants:
    try:
      emu_c = ac.constants_from(cal.read_json(args.emu_constants, "cost-model constants"))
    except (ValueError, TypeError) as e:
      raise UserError(f"{args.emu_constants}: {e}") from None
  if device is not None:
    os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"   # the work counts come from the emulated node
  dirs = artifact_dirs(args.artifact)
  names = _names(Path(args.artifact), dirs)
  if device is not None and sorted(device) != sorted(names):
    raise UserError(f"{args.timings}: it calibrated {', '.join(sorted(device))}, not {', '.join(names)}: pass the artifact or bundle the device ran")
  clock_before = cal.gpu_clock()
  measured = []
  for d, name in zip(dirs, names):
    if len(dirs) > 1:
      print(f"== {name}", flush=True)
    m = cal.measure(d, name, args.repeat, emu_c, args.frames, None if device is None else device[name], str(args.timings))
    if m.entry["tiles"]:
      print(f"register tiles: {len(m.entry['tiles'])} big image convolutions also timed at "
            f"{', '.join(str(1 + len(r['variants'])) for r in m.entry['tiles'])} tile sizes")
    measured.append(m)
  from tinygrad import Device
  dev: Any = Device[Device.DEFAULT]
  emulated = getattr(dev.iface, "node", None) is not None
  clock = {"before": clock_before, "after": cal.gpu_clock()} if device is None else device_clock   # the device's, read back
  if clock is not None:
    print(cal.clock_line(clock.get("before"), clock.get("after")))
  out: dict = {"format": cal.FORMAT, "path": str(args.artifact), "device": type(dev.iface).__name__, "gpu_clock": clock,
               "clock": "cost model of executed work (emulated node)" if emulated and device is None else "GPU always-on counter (19.2 MHz)",
               "repeat": args.repeat, "constants": None, "shipped": ac.constants_dict(ac.DEFAULT), "artifacts": [m.entry for m in measured]}
  times = [t for m in measured for t in m.times]
  fitted = None
  if all(t.work is not None for t in times):
    from backend.a630_timing import fit_kernels
    fitted, res = fit_kernels(times)   # one set of constants for every launch of every artifact
    out["constants"] = ac.constants_dict(fitted)
    worst = max(abs(f - m) / m for _, m, f in res)
    print(f"{len(times)} kernel launches timed; fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in out["constants"].items()))
    print(f"residuals: worst {100 * worst:.1f} %, all launches {sum(m for _, m, _ in res) / 1e3:.2f} ms measured vs "
          f"{sum(f for _, _, f in res) / 1e3:.2f} ms fitted")
    at = 0
    for m in measured:   # every launch has its work and a time > 0 here, so the residuals are the launches' own, in order
      mine, at = res[at:at + len(m.times)], at + len(m.times)
      m.entry["residuals"] = [{"index": t.index, "kernel": k, "measured_us": round(mu, 3), "fitted_us": round(fu, 3), "variant_of": t.variant_of}
                              for t, (k, mu, fu) in zip(m.times, mine, strict=True)]
  else:
    print(f"{len(times)} kernel launches timed ({sum(t.measured_us for t in times) / 1e3:.2f} ms one after another); no emulator here: "
          f"send {args.output} back and fit it with `modeld-msm calibrate-a630 --artifact {args.artifact} --timings {args.output} "
          "-o fitted.json` (the same artifact or bundle)")
  for m in measured:
    if f := m.entry.get("frames"):
      kernels_ms = sum(t.measured_us for t in m.base) / 1e3
      model_ms = None if fitted is None else ac.frame_us([t.work for t in m.base], fitted) / 1e3
      m.entry["frames"] = {**f, "kernels_alone_ms": round(kernels_ms, 3), "model_ms": None if model_ms is None else round(model_ms, 3)}
      for line in cal.frames_lines(f, kernels_ms, model_ms):
        print(line if len(measured) == 1 else f"{m.entry['artifact']}: {line}")
  from selfdrive_glue.files import write_atomic
  write_atomic(args.output, json.dumps(out, indent=1))
  if args.plot and fitted is not None:
    from offcar.calib_plot import plot_calibration
    plot_calibration(out, Path(args.plot))
    print(f"plot: {args.plot}")
  elif args.plot:
    print(f"no fit here, so no plot: fit {args.output} with --timings on a build machine and --plot there")
  return 0
