"""One QCOM artifact measured for `modeld-msm calibrate-a630`: every kernel launch of a frame timed alone (with the
register-tile variants of the big image convolutions), then whole frames as served with the waits for idle kept and with
the independent ones dropped. The fit across artifacts and the report are the command's (cli/commands/calibrate_a630.py);
the file a device writes is read back here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

from selfdrive_glue.errors import UserError

FORMAT = "modeld-msm a630 calibration 2"
DEVICE_FRAMES, EMU_FRAMES = 20, 2   # whole frames a leg by default: a device's wall clock varies, the emulator's model does not
INPUTS = 4   # distinct camera buffers the frames cycle through (the recurrent state still differs frame to frame)
WORK_FIELDS = ("alu", "sfu", "tex", "nbytes", "fibers", "groups", "group_size", "regs")


def program_frame(art):
  """(callable that runs frame i and returns its raw outputs, the artifact's JITs by part: "model", then "warp" where the
  kind has a warp-only program for dropped frames (a frame does not run it)) for its kind. The frames cycle through INPUTS seeded camera
  buffers made here, so a timed frame spends nothing on making its input."""
  import numpy as np

  from selfdrive_glue.nv12 import nv12_info

  def pool(size: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(INPUTS)]
  if art.spec.process == "dmonitoringmodeld":
    from modeld_msm.dm_core import DMonitoringCore
    core = DMonitoringCore(art)
    bufs = pool(nv12_info(*core.camera).size)
    return (lambda i: core.run(bufs[i % INPUTS])), {"model": core.program.jit}
  from modeld_msm.model_state import ModelState
  ms = ModelState(art)
  bufs = pool(ms.nv12.size)
  eye = np.eye(3, dtype=np.float32)
  desire, traffic, at = np.zeros(8, np.float32), np.array([[1, 0]], np.float32), np.array([[0.2, 0.3]], np.float32)
  jits = {"model": ms.step.jit, **({"warp": ms.warp.jit} if ms.warp is not None else {})}

  def frame(i: int) -> np.ndarray:
    buf = bufs[i % INPUTS]
    return ms.run(buf, buf, eye, eye, desire, traffic, False, action_t=at)[1]
  return frame, jits


def _summary(ms: list[float]) -> dict:
  return {"ms": [round(x, 3) for x in ms], "median_ms": round(median(ms), 3), "min_ms": round(min(ms), 3)}


def time_frame_legs(art, device: str, n: int, emu_c, dispatches: int) -> dict:
  """Whole frames as served, from two fresh loads of the artifact (the same recurrent state at the start), one with every
  wait for idle kept and one with the independent ones dropped (MSM_INDEPENDENT_NO_WFI=1, docs/a630-time.md "Lever:
  wait-for-idle"), on the same inputs: their times and whether their outputs are the same bytes (a dispatch that raced
  one it depends on would change them)."""
  from tinygrad import Device

  from backend.a630_timing import time_frames
  from backend.qcom import NO_WFI_ENV
  dev: Any = Device[device]
  node = getattr(dev.iface, "node", None)
  os.environ[NO_WFI_ENV] = "0"   # the artifact as modeld runs it by default
  kept_ms, kept_out = time_frames(program_frame(art)[0], device, n, emu_c)
  out: dict = {"clock": "cost model of the executed dispatches" if node is not None else "host wall clock, upload to outputs read back",
               "inputs": f"{n} frames cycling {INPUTS} seeded random camera buffers", "dispatches": dispatches, "waits_kept": _summary(kept_ms)}
  stats = getattr(dev.iface, "stats", None)
  if stats is None:
    out["independent_waits_dropped"] = {"skipped": f"{type(dev.iface).__name__} keeps tinygrad's queue: the lever is the MSM interface's"}
    return out
  hazards = len(node.stats.order_hazards) if node is not None else 0
  os.environ[NO_WFI_ENV] = "1"   # read when a graph's queue is made: a second load of the artifact gets its own
  try:
    frame_b, _ = program_frame(art)
    dropped = stats["waits_dropped"]   # from here: the graphs a frame runs (the load binds the warp-only one of dropped frames)
    ms, outs = time_frames(frame_b, device, n, emu_c)
  finally:
    os.environ[NO_WFI_ENV] = "0"
  diff = next((i for i, (a, b) in enumerate(zip(kept_out, outs)) if a != b), None)
  races = [] if node is None else list(node.stats.order_hazards[hazards:])
  out["independent_waits_dropped"] = {**_summary(ms), "waits_dropped": stats["waits_dropped"] - dropped, "identical_outputs": diff is None,
                                      "first_different_frame": diff, "order_hazards": None if node is None else races,
                                      "safe": diff is None and not races}
  return out


def frames_lines(f: dict, kernels_ms: float, model_ms: float | None) -> list[str]:
  """What the frames say, from the times alone (a device's file is read back on the build machine)."""
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


def gpu_clock(sys_root: Path = Path("/sys")) -> dict | None:
  """The GPU's clock as the kernel reports it, in Hz: mainline msm's devfreq device (its name ends in ".gpu"), else KGSL's
  sysfs; None where neither exists (the emulated node). The cost model assumes 710 MHz: a calibration run below it says so."""
  def read(p: Path) -> int | str | None:
    try:
      v = p.read_text().strip()
    except OSError:
      return None
    return int(v) if v.isdigit() else v
  for d in sorted((sys_root / "class" / "devfreq").glob("*.gpu")):
    return {"source": str(d), **{k: read(d / k) for k in ("cur_freq", "min_freq", "max_freq", "governor")}}
  k = sys_root / "class" / "kgsl" / "kgsl-3d0"
  if k.is_dir():
    return {"source": str(k), "cur_freq": read(k / "gpuclk"), "min_freq": None, "max_freq": read(k / "max_gpuclk"),
            "governor": read(k / "devfreq" / "governor")}
  return None


def clock_line(before: Any, after: Any) -> str:
  """The clock a run had, in one line (a device's file read back may hold anything there)."""
  if not isinstance(before, dict):
    return "GPU clock: not readable here (no msm devfreq or KGSL sysfs)"
  hz = [c.get("cur_freq") for c in (before, after) if isinstance(c, dict)]
  top, where = before.get("max_freq"), before.get("source", "?")
  if not isinstance(top, int):
    return f"GPU clock: {hz} Hz ({where})"
  line = (f"GPU clock: {' -> '.join(f'{x / 1e6:.0f}' if isinstance(x, int) else '?' for x in hz)} MHz over the run (max "
          f"{top / 1e6:.0f} MHz, governor {before.get('governor')}; {where})")
  if any(isinstance(x, int) and x < top for x in hz):
    line += "; below its top clock: pin it (devfreq min_freq = max_freq) and run again, the cost model assumes 710 MHz"
  return line


def read_json(path: str | os.PathLike, what: str) -> dict:
  try:
    data = json.loads(Path(path).read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"{path}: not {what} ({e})") from None
  if not isinstance(data, dict):
    raise UserError(f"{path}: not {what} (expected a JSON object)")
  return data


def _frames_ok(f: Any) -> bool:
  def times(leg: Any) -> bool:
    ms = leg.get("ms") if isinstance(leg, dict) else None
    return isinstance(ms, list) and bool(ms) and all(isinstance(x, (int, float)) and x > 0 for x in ms)
  if not isinstance(f, dict) or not times(f.get("waits_kept")):
    return False
  b = f.get("independent_waits_dropped")
  return b is None or (isinstance(b, dict) and ("ms" not in b or times(b)))


def read_device_file(path: str | os.PathLike) -> tuple[dict[str, dict], dict | None]:
  """A calibration a device wrote: -> (its entries by artifact (the name within what was calibrated), each with its kernel
  launches' times and, if timed, its frames; the GPU clock it recorded)."""
  d = read_json(path, "a calibration written by calibrate-a630")
  arts = d.get("artifacts")
  if d.get("format") != FORMAT or not isinstance(arts, list) or not arts or not all(isinstance(a, dict) for a in arts):
    raise UserError(f"{path}: not a calibration written by calibrate-a630 (format '{FORMAT}' with a list of artifacts)")
  out = {}
  for a in arts:
    name, ks = a.get("artifact"), a.get("kernels")
    if not isinstance(name, str) or not isinstance(ks, list) or not ks:
      raise UserError(f"{path}: an artifact entry needs its name and its kernel list")
    for k in ks:
      if not isinstance(k, dict) or not isinstance(k.get("kernel"), str) or not isinstance(k.get("measured_us"), (int, float)) \
         or not k["measured_us"] > 0:
        raise UserError(f"{path}: {name}: kernel entry {k!r} needs a name and a measured_us > 0")
    if "frames" in a and not _frames_ok(a["frames"]):
      raise UserError(f"{path}: {name}: 'frames' needs each leg's frame times (ms > 0), as calibrate-a630 writes them")
    out[name] = a
  clock = d.get("gpu_clock")
  return out, clock if isinstance(clock, dict) else None


@dataclass
class Measured:
  """One artifact's entry of the calibration, and its launches for the fit."""
  entry: dict
  times: list   # backend.a630_timing.KernelTime, in launch order (variants right after the launch they stand in for)

  @property
  def base(self) -> list:
    return [t for t in self.times if t.variant_of is None]


def measure(path: Path, name: str, repeat: int, emu_c, frames: int | None, device_entry: dict | None, source: str) -> Measured:
  """One artifact's kernel launches timed alone and, unless `device_entry` brings a device's times (then the launches
  are executed here for their work and must be the device's, in order), `frames` whole frames in both legs."""
  from tinygrad import Device

  from artifact.format import verify_artifact
  from backend.a630_timing import Recorder, time_kernels
  from compile.tuning.qcom_tiles import calibration_launches
  art = verify_artifact(path, device="QCOM")
  frame, jits = program_frame(art)
  recs = [Recorder(j) for j in jits.values()]
  frame(0)
  dev: Any = Device[Device.DEFAULT]
  emulated = getattr(dev.iface, "node", None) is not None
  if device_entry is not None and not emulated:
    raise UserError("--timings needs the emulated render node (MODELD_DEV=EMU+QCOM:IR3 and tinymesa): run it on a build machine")
  # the big image convolutions at two or three register-tile sizes: their compiled variants ship with the tile table
  times = time_kernels(recs, Device.DEFAULT, repeat, emu_c, variants=calibration_launches())
  del frame, jits, recs   # their buffers: the frames load the artifact afresh
  if device_entry is not None:
    rows = device_entry["kernels"]
    if [r["kernel"] for r in rows] != [t.kernel for t in times]:
      raise UserError(f"{source}: {name}: its kernels are not this artifact's ({len(rows)} vs {len(times)} launches, or other names)")
    times = [replace(t, measured_us=float(r["measured_us"])) for t, r in zip(times, rows)]
  entry: dict = {"artifact": name, "kind": art.kind, "camera": "{}x{}".format(*art.camera), "kernels": [
    {"index": t.index, "kernel": t.kernel, "global": list(t.global_size), "local": list(t.local_size), "measured_us": round(t.measured_us, 3),
     "variant_of": t.variant_of, "opts": t.opts, "work": None if t.work is None else {k: getattr(t.work, k) for k in WORK_FIELDS}}
    for t in times]}
  entry["tiles"] = [{"kernel": times[i].kernel, "measured_us": round(times[i].measured_us, 3),
                     "variants": [{"kernel": t.kernel, "opts": t.opts, "measured_us": round(t.measured_us, 3)} for t in times if t.variant_of == i]}
                    for i in sorted({t.variant_of for t in times if t.variant_of is not None})]
  m = Measured(entry, times)
  if device_entry is not None:
    if device_entry.get("frames"):
      entry["frames"] = device_entry["frames"]
    return m
  n = frames if frames is not None else EMU_FRAMES if emulated else DEVICE_FRAMES
  if n:
    entry["frames"] = time_frame_legs(art, Device.DEFAULT, n, emu_c, len(m.base))
  return m
