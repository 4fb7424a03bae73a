"""Per-frame cost of the modeld step at 20 Hz: warp, model, parse, fill+publish (p50/p99), CPU use, drops, RSS.

Runs ModeldCore in real time against pre-rendered camera frames (rendering is not modeld's cost) and publishes
over our msgq to a live reader, like the service. A step that overruns its 50 ms slot makes the next frame(s) be
skipped, as VisionIPC conflate would: those are the dropped frames. The warp is measured as its own JIT (the
prepare-only program); "model" is the fused step minus one warp.

  .venv/bin/python bench/bench_modeld.py --size tiny --frames 2000
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb(field: str = "VmRSS") -> float:
  """VmRSS counts the msgq ring pages (shared memory, bounded by the ring size) as they are first touched; RssAnon is the
  process's private memory, the number that would show a leak."""
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1]) / 1024
  return float("nan")


def pct(a, q):
  return float(np.percentile(np.asarray(a) * 1e3, q)) if len(a) else float("nan")


def bench(size: str, frames: int, camera: str) -> dict:
  os.environ.setdefault("OPENPILOT_PREFIX", f"bench{uuid.uuid4().hex[:6]}")
  from modeld_msm.core import Frame, ModeldCore
  from offcar.demo import cached_artifact
  from selfdrive_glue import messaging
  from selfdrive_glue.nv12 import parse_camera
  from selfdrive_glue.road_render import RoadScene
  w, h = parse_camera(camera)
  art = cached_artifact(size, camera, "CPU", log=lambda *a: print(*a, file=sys.stderr))
  meta = json.loads((art / "metadata.json").read_text())
  core = ModeldCore(art)
  scene = RoadScene(0, camera)
  info = core.model.nv12
  bufs = []
  for i in range(4):
    road, wide = np.zeros(info.size, np.uint8), np.zeros(info.size, np.uint8)
    scene.render_into(road, i * 0.05, "road")
    scene.render_into(wide, i * 0.05, "wide")
    bufs.append((road, wide))
  for svc, kw in (("deviceState", {"deviceType": "tici"}), ("roadCameraState", {"sensor": "ar0231"}), ("liveCalibration", {"rpyCalib": [0, 0, 0]})):
    e = messaging.new_message(svc, valid=True)
    for k, v in kw.items():
      setattr(getattr(e, svc), k, v)
    core.on_message(messaging.log_from_bytes(e.to_bytes()))
  pm = messaging.PubMaster(["modelV2", "drivingModelData", "cameraOdometry"])
  sub = messaging.SubMaster(["modelV2"])
  # warm up (first calls include lazy program loading)
  for n in range(1, 6):
    core.on_frame(Frame(bufs[n % 4][0], n, 0, 0), Frame(bufs[n % 4][1], n, 0, 0))
  warp_t = []
  for _ in range(20):
    t = time.perf_counter()
    core.model._call(core.model.warp, core.model._frame("main", bufs[0][0]), core.model._frame("extra", bufs[0][1]))
    warp_t.append(time.perf_counter() - t)
  warp_med = float(np.median(warp_t))
  step_t, parse_t, fill_t, pub_t = [], [], [], []
  rss0, anon0, ru0, t_wall0 = rss_mb(), rss_mb("RssAnon"), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
  start = time.monotonic_ns()
  n, fid, dropped = 0, 100, 0
  core.last_vipc_frame_id = fid - 1
  while n < frames:
    slot = start + n * 50_000_000
    now = time.monotonic_ns()
    if now < slot:
      time.sleep((slot - now) / 1e9)
    elif now - slot >= 50_000_000:
      skip = (now - slot) // 50_000_000   # frames that arrived while we were busy: conflate keeps only the newest
      dropped += int(skip)
      n += int(skip)
      fid += int(skip)
      continue
    road, wide = bufs[n % 4]
    out = core.on_frame(Frame(road, fid, now, now), Frame(wide, fid, now, now))
    jit_s, parse_s = core.model.last_times
    if out:
      t = time.perf_counter()
      for svc, dat in out:
        pm.send(svc, dat)
      pub_t.append(time.perf_counter() - t)
      step_t.append(jit_s)
      parse_t.append(parse_s)
      fill_t.append(core.stats.last.fill_s)
    sub.update(0)
    n += 1
    fid += 1
  ru1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t_wall0
  cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / wall
  return {"size": size, "frames": frames, "steps": len(step_t), "dropped": dropped, "warp_ms_p50": warp_med * 1e3,
          "model_ms_p50": pct(step_t, 50) - warp_med * 1e3, "model_ms_p99": pct(step_t, 99) - warp_med * 1e3,
          "step_ms_p50": pct(step_t, 50), "step_ms_p99": pct(step_t, 99), "parse_ms_p50": pct(parse_t, 50), "parse_ms_p99": pct(parse_t, 99),
          "fill_ms_p50": pct(fill_t, 50), "fill_ms_p99": pct(fill_t, 99), "publish_ms_p50": pct(pub_t, 50), "publish_ms_p99": pct(pub_t, 99),
          "cpu_cores": cpu, "rss_mb_start": rss0, "rss_mb_end": rss_mb(),
          "anon_mb_start": anon0, "anon_mb_end": rss_mb("RssAnon"), "load_end": os.getloadavg()[0],
          # what the artifact was compiled with: the step's speed depends on it (compile/precision.py, cpu_layout.py, cpu_search.py)
          "compiled": f"{meta['precision']['compute']}, layout {'on' if meta.get('cpu_layout', {}).get('on') else 'off'}, "
                      f"search {('BEAM=' + str(meta['search']['beam'])) if meta.get('search', {}).get('used') else 'off'}"}


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", action="append", choices=["tiny", "full"], help="model size (repeatable; default tiny and full)")
  ap.add_argument("--frames", type=int, default=2000)
  ap.add_argument("--camera", default="1928x1208")
  a = ap.parse_args()
  from artifact.cpu_info import cpu_info
  load0 = os.getloadavg()[0]
  rows = [bench(s, a.frames, a.camera) for s in (a.size or ["tiny", "full"])]
  # the box may be shared with other jobs: the load average says how much of the 20 Hz budget others took
  print(f"CPU: {cpu_info().summary()}; 1-min loadavg {load0:.1f} at start, {rows[-1]['load_end']:.1f} at the end")
  cols = [("size", "{}"), ("compiled", "{}"),
          ("frames", "{}"), ("steps", "{}"), ("dropped", "{}"), ("warp_ms_p50", "{:.2f}"), ("model_ms_p50", "{:.2f}"),
          ("model_ms_p99", "{:.2f}"), ("step_ms_p50", "{:.2f}"), ("step_ms_p99", "{:.2f}"), ("parse_ms_p50", "{:.3f}"), ("parse_ms_p99", "{:.3f}"),
          ("fill_ms_p50", "{:.3f}"), ("publish_ms_p50", "{:.3f}"), ("publish_ms_p99", "{:.3f}"), ("cpu_cores", "{:.2f}"),
          ("rss_mb_start", "{:.1f}"), ("rss_mb_end", "{:.1f}"), ("anon_mb_start", "{:.1f}"), ("anon_mb_end", "{:.1f}")]
  print("| " + " | ".join(c for c, _ in cols) + " |")
  print("|" + "---|" * len(cols))
  for r in rows:
    print("| " + " | ".join(f.format(r[c]) for c, f in cols) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
