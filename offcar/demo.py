"""`modeld-msm demo`: the whole pipeline on one box, as separate processes over our msgq + VisionIPC, like on the car.

  demo_camera (rendered road + wide frames, sensor services)  --VisionIPC/msgq-->  modeld  --msgq-->  listener (here)
               (rendered driver camera)                     --VisionIPC/msgq-->  dmonitoringmodeld  --msgq-->

Ends with a summary table, demo-out/summary.json and demo-out/plan.png (and dm.png: driverStateV2 against the cabin).
The renderer knows what it drew, so every modelV2 is also held to the truth of its frame (offcar/replay_accuracy.py): lane lines at 20 m in metres and
desiredCurvature against the curvature the ego path has at modeld's lateral action time. The models are the trained
tiny stand-in by default (its outputs mean something), or random weights (`--random-weights`, plumbing only).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from artifact import kinds
from artifact.cpu_info import cpu_info
from artifact.format import ArtifactError, installed_versions, verify_artifact
from compile.build import compile_artifact
from compile.precision import choose
from compile.programs import recipe_of
from modeld_msm.constants import X_IDXS
from offcar import dm_accuracy
from offcar.accuracy import CURVATURE_CORR_LIMIT, LANE_ERROR_DISTANCE, LANE_ERROR_LIMIT_M
from offcar.demo_camera import LATERAL_DELAY, scene_time
from offcar.replay_accuracy import TruthSource, evaluate, json_number, lane_lines_y, lat_action_t
from selfdrive_glue import messaging
from selfdrive_glue.cabin_render import CabinScene
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import replacing, write_atomic
from selfdrive_glue.messaging import drain_sock_raw
from selfdrive_glue.nv12 import parse_camera

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "modeld-msm"


@dataclass
class DemoOptions:
  full: bool = False
  seconds: float = 20.0
  out: Path = Path("demo-out")
  camera: str = "1928x1208"
  device: str = "CPU"
  seed: int = 0
  random_weights: bool = False  # the random-weight reference models instead of the trained stand-in (tiny only has one)
  dm: bool = True               # also the driver camera and dmonitoringmodeld
  kind: str = "driving"         # the driving kind modeld serves: "supercombo", the same weights fused into master's combined model


def weights_name(opts: DemoOptions) -> str:
  return "stand-in" if not opts.random_weights and not opts.full else "random"


def _cached(dirname: str, salt: str, models: list[Path], camera: str, device: str, process: str, compile_into, what: str, log,
            tag: str) -> Path:
  """An artifact cached under ~/.cache/modeld-msm by the hash of everything that shapes it (salt, the models' bytes, the
  camera, device, versions, precision, CPU and our compile code), compiled by compile_into(path) when it is not there."""
  h = hashlib.sha256(salt.encode())
  for m in models:
    h.update(m.read_bytes())
  # a CPU artifact is machine code for this CPU (-march=native): a cache carried to another CPU must not hand it over
  h.update(json.dumps([camera, device, installed_versions(), choose(device, "auto")[0], cpu_info().as_dict()]).encode())
  # the program is built by our own code too: a change there must not reuse a stale artifact
  for src in sorted((Path(__file__).resolve().parents[1] / "compile").rglob("*.py")):
    h.update(src.read_bytes())
  art = CACHE / f"{dirname}-{camera}-{device.replace(':', '_')}-{h.hexdigest()[:16]}"
  try:
    verify_artifact(art, device=device.split(":")[0], camera=parse_camera(camera), process=process)
    log(f"[{tag}] using cached artifact {art} ({what})")
    return art
  except ArtifactError:
    pass
  log(f"[{tag}] compiling the {what} for {camera} on {device} (cached afterwards)")
  t = time.perf_counter()
  report = compile_into(art)
  log(report.table())
  log(f"[{tag}] compiled in {time.perf_counter() - t:.1f}s")
  return art


def cached_artifact(size: str, camera: str, device: str, log=print, stand_in: bool = False, tag: str = "demo", kind: str = "driving") -> Path:
  """A kind's reference models -> artifact, cached (_cached). stand_in: the trained tiny stand-in weights instead of random
  ones (master's combined model: the stand-in pair fused)."""
  k = kinds.get(kind)
  with tempfile.TemporaryDirectory(prefix="modeld-msm-models-") as td:
    written = recipe_of(k).write_models(td, size, 0, stand_in=stand_in)
    # the weights' bytes are hashed as well; naming them keeps the two apart even by directory name
    weights = "standin" if stand_in else "random"
    models = {m: written[m].path for m in k.models}
    return _cached(f"{k.name}-{size}-{weights}", weights, list(models.values()), camera, device, k.process,
                   lambda art: compile_artifact(k, models, parse_camera(camera), device, art, log=log),
                   f"{size} reference {k.title} ({weights} weights)", log, tag)


def rss_mb(pid: int) -> float | None:
  try:
    for line in open(f"/proc/{pid}/status"):
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


@dataclass
class Trace:
  t: list[float] = field(default_factory=list)
  frame_id: list[int] = field(default_factory=list)
  exec_ms: list[float] = field(default_factory=list)
  latency_ms: list[float] = field(default_factory=list)
  drop_perc: list[float] = field(default_factory=list)
  lane_y: list[list[float]] = field(default_factory=list)      # 4 lane lines, y at 20 m
  lane_lines: list[np.ndarray] = field(default_factory=list)   # (4, 33) lane line y on X_IDXS, for the truth comparison
  plan_y: list[float] = field(default_factory=list)            # plan lateral position at ~20 m
  curvature: list[float] = field(default_factory=list)
  accel: list[float] = field(default_factory=list)
  valid: list[bool] = field(default_factory=list)


def _tally(socks: dict, counts: dict[str, int]) -> None:
  for s, sock in socks.items():
    counts[s] += len(drain_sock_raw(sock))


def _record(trace: Trace, m, t: float, valid: bool) -> None:
  trace.t.append(t)
  trace.frame_id.append(m.frameId)
  trace.exec_ms.append(m.modelExecutionTime * 1e3)
  trace.latency_ms.append((time.monotonic_ns() - m.timestampEof) / 1e6)
  trace.drop_perc.append(m.frameDropPerc)
  lanes = lane_lines_y(m.laneLines)
  trace.lane_lines.append(lanes)
  # at 20 m exactly (between grid points), where the truth is compared
  trace.lane_y.append([float(np.interp(20.0, X_IDXS, ll)) for ll in lanes] if lanes.shape == (4, 33) else [float("nan")] * 4)
  px, py = list(m.position.x), list(m.position.y)
  trace.plan_y.append(float(np.interp(20.0, px, py)) if px else float("nan"))
  trace.curvature.append(m.action.desiredCurvature)
  trace.accel.append(m.action.desiredAcceleration)
  trace.valid.append(valid)


def run_demo(opts: DemoOptions) -> dict:
  from tqdm import tqdm
  opts.out.mkdir(parents=True, exist_ok=True)
  size = "full" if opts.full else "tiny"
  art = cached_artifact(size, opts.camera, opts.device, stand_in=not opts.random_weights and size == "tiny", kind=opts.kind)
  dm_art = cached_artifact("tiny", opts.camera, opts.device, stand_in=not opts.random_weights, kind="dmonitoring") if opts.dm else None
  prefix = f"demo{uuid.uuid4().hex[:8]}"
  env = dict(os.environ, OPENPILOT_PREFIX=prefix, PYTHONUNBUFFERED="1")
  os.environ["OPENPILOT_PREFIX"] = prefix  # the listener in this process uses the same namespace
  stats_file = opts.out / ".camera-stats.json"
  logs = {n: open(opts.out / f"{n}.log", "w") for n in ("camera", "modeld") + (("dmonitoringmodeld",) if opts.dm else ())}
  # every message read, not conflated as SubMaster's sockets are (openpilot's semantics: on a busy box two messages of a
  # service between two wake-ups are one there); the loop wakes on modelV2
  poller = messaging.Poller()
  model_sock = messaging.sub_sock("modelV2", poller=poller, conflate=False)
  tally = {s: messaging.sub_sock(s, conflate=False) for s in ("drivingModelData", "cameraOdometry")}
  dm_sock = messaging.sub_sock("driverStateV2", conflate=False) if opts.dm else None
  modeld = subprocess.Popen([sys.executable, "-m", "modeld_msm.modeld", "--artifact", str(art), "--demo"], env=env,
                            stdout=logs["modeld"], stderr=subprocess.STDOUT)
  procs = [modeld]
  if dm_art is not None:
    procs.append(subprocess.Popen([sys.executable, "-m", "modeld_msm.dmonitoringmodeld", "--artifact", str(dm_art)], env=env,
                                  stdout=logs["dmonitoringmodeld"], stderr=subprocess.STDOUT))
  camera = subprocess.Popen([sys.executable, "-m", "offcar.demo_camera", "--camera", opts.camera, "--seconds", str(opts.seconds),
                             "--seed", str(opts.seed), "--stats", str(stats_file)] + (["--driver"] if opts.dm else [])
                            + (["--master-names"] if kinds.get(opts.kind).renamed_services else []),
                            env=env, stdout=logs["camera"], stderr=subprocess.STDOUT)
  trace = Trace()
  dm_preds: list[dm_accuracy.DMPrediction] = []
  counts = {"modelV2": 0, "drivingModelData": 0, "cameraOdometry": 0} | ({"driverStateV2": 0} if opts.dm else {})

  def drain_model() -> Any:
    """Every modelV2 since the last call, each counted and in the trace; the newest, or None."""
    last = None
    for dat in drain_sock_raw(model_sock):
      evt = messaging.log_from_bytes(dat)
      counts["modelV2"] += 1
      _record(trace, evt.modelV2, time.monotonic() - t0, evt.valid)
      bar.update(1)
      last = evt.modelV2
    return last

  def drain_dm() -> None:
    if dm_sock is not None:
      for dat in drain_sock_raw(dm_sock):
        counts["driverStateV2"] += 1
        ds = messaging.log_from_bytes(dat).driverStateV2
        dm_preds.append(dm_accuracy.prediction(ds, scene_time(ds.frameId)))
  rss_start = rss_end = None
  expected = int(opts.seconds * 20)
  t0 = time.monotonic()
  # a log file gets a line every few seconds, a terminal a live bar
  bar = tqdm(total=expected, unit="frame", desc="modelV2", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 5.0)
  try:
    while True:
      poller.poll(100)
      _tally(tally, counts)
      drain_dm()
      if (m := drain_model()) is not None:
        if rss_start is None:
          rss_start = rss_mb(modeld.pid)
        rss_end = rss_mb(modeld.pid) or rss_end
        bar.set_postfix_str(f"{m.modelExecutionTime * 1e3:.1f} ms/frame, drop {m.frameDropPerc:.1f}%")
      if camera.poll() is not None:
        # let the last frames drain through modeld
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
          poller.poll(100)
          drain_model()
          drain_dm()
        _tally(tally, counts)
        drain_dm()
        break
      for p, name in zip(procs, ("modeld", "dmonitoringmodeld")):
        if p.poll() is not None:
          raise UserError(f"{name} exited early with code {p.returncode}; see {opts.out / (name + '.log')}")
      if time.monotonic() - t0 > opts.seconds + 600:
        raise UserError("demo timed out waiting for the camera process")
  finally:
    bar.close()
    for p in (camera, *procs):
      if p.poll() is None:
        p.send_signal(signal.SIGINT)
    for p in (camera, *procs):
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()
    for f in logs.values():
      f.close()
  cam_stats = json.loads(stats_file.read_text()) if stats_file.exists() else {"frames_sent": None, "late_frames": None}
  stats_file.unlink(missing_ok=True)
  truth = against_truth(trace, opts)
  summary = summarize(trace, counts, cam_stats, rss_start, rss_end, art, opts) | truth.summary
  if opts.dm:
    acc = dm_accuracy.evaluate(CabinScene(opts.seed, opts.camera), dm_preds)
    dm_weights = "random" if opts.random_weights else "stand-in"
    summary |= {"dm_artifact": str(dm_art), "dm_weights": dm_weights} | {k: json_number(v) if isinstance(v, float) else v
                                                                         for k, v in acc.summary().items()}
    plot_dm(dm_preds, acc, opts.out / "dm.png", dm_weights)
  write_atomic(opts.out / "summary.json", json.dumps(summary, indent=1))
  plot(trace, opts.out / "plan.png", summary, truth.trace)
  return summary


def plot_dm(preds: list[dm_accuracy.DMPrediction], acc: dm_accuracy.DMAccuracy, path: Path, weights: str) -> None:
  """driverStateV2 (solid) against the cabin's truth (dashed): face pitch/yaw, faceProb against a face being there, blinks."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
  t = np.array([p.t for p in preds])
  tr = acc.truths
  if len(t):
    for i, (name, key) in enumerate((("pitch", "pitch"), ("yaw", "yaw"))):
      line, = ax[0].plot(t, [np.degrees(p.orientation[i]) for p in preds], lw=1, label=name)
      ax[0].plot(t, [np.degrees(getattr(x, key)) if x.face else np.nan for x in tr], "--", color=line.get_color(), lw=1)
    ax[1].plot(t, [p.face_prob for p in preds], label="faceProb")
    ax[1].plot(t, [float(x.face) for x in tr], "--", label="a face is there")
    ax[2].plot(t, [p.blink_prob for p in preds], label="blink prob (mean of both eyes)")
    ax[2].plot(t, [float(x.eyes_closed) if x.face else np.nan for x in tr], "--", label="eyes closed")
  ax[0].set_ylabel("degrees")
  ax[0].set_title(f"face orientation vs truth (dashed): error p50 {_fmt(acc.face_orientation_err_deg_p50, '.1f')} deg "
                  f"(bar {dm_accuracy.FACE_ORIENTATION_LIMIT_DEG:g})", fontsize=9)
  ax[1].set_title(f"faceProb: AUC {_fmt(acc.face_prob_auc, '.3f')} (bar {dm_accuracy.FACE_PROB_AUC_LIMIT:g})", fontsize=9)
  ax[2].set_title(f"blinks: accuracy {_fmt(acc.blink_accuracy, '.3f')} (bar {dm_accuracy.BLINK_ACCURACY_LIMIT:g}), "
                  f"closed eyes caught {_fmt(acc.blink_recall, '.3f')}", fontsize=9)
  ax[2].set_xlabel("scene time (s)")
  for a in ax:
    a.legend(loc="upper right", fontsize=8)
  note = ("the trained tiny stand-in (modeld-msm train-dm)" if weights == "stand-in" else
          "random-weight tiny model: the numbers are the pipeline's, not a model's")
  fig.suptitle(f"modeld-msm demo: dmonitoringmodeld on the rendered cabin, {acc.frames} driverStateV2 ({note})", fontsize=9)
  fig.tight_layout()
  with replacing(path, ".png") as tmp:
    fig.savefig(tmp, dpi=80)
  plt.close(fig)


@dataclass
class TruthTrace:
  summary: dict                                              # summary.json's accuracy fields
  trace: dict[str, np.ndarray] = field(default_factory=dict)  # per received message: lane_y (n, 4) at 20 m, curvature (n,)


def against_truth(trace: Trace, opts: DemoOptions) -> TruthTrace:
  """Each modelV2 against what the renderer drew in its frame (demo_camera.scene_time of its frameId)."""
  lat_t = lat_action_t(LATERAL_DELAY)
  source = TruthSource(opts.seed, opts.camera, {fid: (scene_time(fid), lat_t) for fid in trace.frame_id})
  ev = evaluate(source, zip(trace.frame_id, trace.lane_lines, trace.curvature), "demo")
  s = ev.summary
  summary = {"weights": weights_name(opts), "kind": opts.kind, "accuracy_frames": s["frames"], "accuracy_skipped_frames": s["skipped_frames"],
             **{k: json_number(s[k]) for k in ("lane_error_m_p50", "lane_error_m_p90", "curvature_corr", "curvature_mae")},
             "accuracy_passes": s["passes"]}
  truths = [ev.truths[fid] for fid in trace.frame_id]
  return TruthTrace(summary, {"lane_y": np.array([tr.lane_y_at(LANE_ERROR_DISTANCE) for tr in truths]).reshape(-1, 4),
                              "curvature": np.array([tr.desired_curvature for tr in truths])})


def summarize(trace: Trace, counts, cam_stats, rss_start, rss_end, art: Path, opts: DemoOptions) -> dict:
  ex = np.array(trace.exec_ms[1:] or [float("nan")])
  lat = np.array(trace.latency_ms[1:] or [float("nan")])
  sent = cam_stats.get("frames_sent")
  return {
    "models": "full" if opts.full else "tiny", "camera": opts.camera, "device": opts.device, "artifact": str(art),
    "cpu": cpu_info().as_dict(),   # what decided the kernels: the numbers below are this CPU's
    "seconds": opts.seconds,
    "frames_sent": sent, "frames_received": counts["modelV2"], "published": counts,
    "frames_dropped": (sent - counts["modelV2"]) if sent is not None else None,
    # after modeld's first output (start-up, while it loads, is not a drop openpilot would see: camerad starts first)
    "frames_dropped_running": (trace.frame_id[-1] - trace.frame_id[0] + 1 - len(trace.frame_id)) if trace.frame_id else None,
    "dropped_ratio_running": ((trace.frame_id[-1] - trace.frame_id[0] + 1 - len(trace.frame_id)) / (trace.frame_id[-1] - trace.frame_id[0] + 1))
                             if trace.frame_id else None,
    "camera_late_frames": cam_stats.get("late_frames"),
    "ms_per_frame_p50": float(np.nanpercentile(ex, 50)), "ms_per_frame_p99": float(np.nanpercentile(ex, 99)),
    "eof_to_publish_ms_p50": float(np.nanpercentile(lat, 50)), "eof_to_publish_ms_p99": float(np.nanpercentile(lat, 99)),
    "max_frameDropPerc": float(max(trace.drop_perc, default=0.0)),
    "valid_ratio": float(np.mean(trace.valid)) if trace.valid else None,
    "rss_mb_start": rss_start, "rss_mb_end": rss_end,
  }


def plot(trace: Trace, path: Path, summary: dict, truth: dict[str, np.ndarray] | None = None) -> None:
  """Predictions solid, the renderer's truth dashed in the same colour."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
  t = np.array(trace.t)
  if len(t):
    lanes = np.array(trace.lane_y)
    for i in range(lanes.shape[1]):
      line, = ax[0].plot(t, lanes[:, i], lw=1, label=f"lane line {i}")
      if truth is not None and len(truth["lane_y"]) == len(t):
        ax[0].plot(t, truth["lane_y"][:, i], "--", color=line.get_color(), lw=1, label="truth" if i == 0 else None)
    ax[0].plot(t, trace.plan_y, "k", lw=2, label="plan")
    ax[1].plot(t, trace.curvature, label="desiredCurvature")
    if truth is not None and len(truth["curvature"]) == len(t):
      ax[1].plot(t, truth["curvature"], "--", color="tab:blue", label="true curvature at the action time")
    ax2 = ax[1].twinx()
    ax2.plot(t, trace.accel, "tab:red", label="desiredAcceleration")
    ax2.set_ylabel("m/s²", color="tab:red")
    ax[2].plot(t, trace.exec_ms, label="modelExecutionTime")
    ax[2].plot(t, trace.latency_ms, label="EOF → received")
  ax[0].set_ylabel("lateral y at 20 m (m)")
  ax[0].legend(loc="upper right", fontsize=8)
  ax[1].set_ylabel("1/m")
  ax[1].legend(loc="upper left", fontsize=8)
  if len(trace.exec_ms) > 2:  # the first step includes start-up; keep the steady state readable
    ax[2].set_ylim(0, 1.5 * float(np.nanpercentile(trace.exec_ms[1:] + trace.latency_ms[1:], 99)))
  ax[2].set_ylabel("ms")
  ax[2].set_xlabel("s")
  ax[2].legend(loc="upper right", fontsize=8)
  fig.suptitle(f"modeld-msm demo: {summary['models']} models ({summary.get('weights', '?')} weights), {summary['camera']}, "
               f"{summary['device']} — p50 {summary['ms_per_frame_p50']:.1f} ms/frame, {summary['frames_received']} frames")
  if "lane_error_m_p50" in summary:
    ax[0].set_title(f"lane lines at 20 m vs truth (dashed): error p50 {_fmt(summary['lane_error_m_p50'], '.2f')} m, "
                    f"p90 {_fmt(summary['lane_error_m_p90'], '.2f')} m", fontsize=9)
    ax[1].set_title(f"desiredCurvature vs truth (dashed): r {_fmt(summary['curvature_corr'], '.3f')}", fontsize=9)
  fig.tight_layout()
  with replacing(path, ".png") as tmp:
    fig.savefig(tmp, dpi=90)
  plt.close(fig)


def _fmt(v, spec: str) -> str:
  return "n/a" if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def print_summary(s: dict) -> None:
  rows = [("frames sent (camera)", s["frames_sent"]), ("modelV2 received", s["frames_received"]),
          ("drivingModelData / cameraOdometry", f"{s['published']['drivingModelData']} / {s['published']['cameraOdometry']}"),
          ("frames dropped (total / after modeld started)", f"{s['frames_dropped']} / {s['frames_dropped_running']}"),
          ("ms/frame p50 / p99 (modelExecutionTime)", f"{s['ms_per_frame_p50']:.2f} / {s['ms_per_frame_p99']:.2f}"),
          ("EOF → listener ms p50 / p99", f"{s['eof_to_publish_ms_p50']:.2f} / {s['eof_to_publish_ms_p99']:.2f}"),
          ("max frameDropPerc", f"{s['max_frameDropPerc']:.2f}"),
          ("modeld RSS MB start / end", f"{s['rss_mb_start']} / {s['rss_mb_end']}"),
          (f"lane error at 20 m vs truth, m p50 / p90 (limit {LANE_ERROR_LIMIT_M})",
           f"{_fmt(s['lane_error_m_p50'], '.3f')} / {_fmt(s['lane_error_m_p90'], '.3f')}  ({s['weights']} weights, {s['accuracy_frames']} frames)"),
          (f"desiredCurvature vs truth: r (limit {CURVATURE_CORR_LIMIT}) / MAE 1/m",
           f"{_fmt(s['curvature_corr'], '.3f')} / {_fmt(s['curvature_mae'], '.2e')}")]
  if "dm_frames" in s:
    rows += [("driverStateV2 received", s["published"]["driverStateV2"]),
             (f"face orientation error deg p50 / faceProb AUC / blink accuracy (bars {dm_accuracy.FACE_ORIENTATION_LIMIT_DEG:g} / "
              f"{dm_accuracy.FACE_PROB_AUC_LIMIT:g} / {dm_accuracy.BLINK_ACCURACY_LIMIT:g})",
              f"{_fmt(s['face_orientation_err_deg_p50'], '.1f')} / {_fmt(s['face_prob_auc'], '.3f')} / {_fmt(s['blink_accuracy'], '.3f')}"
              f"  ({s['dm_weights']} weights)")]
  w = max(len(k) for k, _ in rows)
  print("\n" + "\n".join(f"  {k:{w}s}  {v}" for k, v in rows))
