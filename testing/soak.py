"""Soak: N frames at 20 Hz (level B: slower, see below) through real processes (the demo's camera server, modeld, a listener here), sampling modeld's
resources from /proc, and printing start/end/slope per resource.

  .venv/bin/python testing/soak.py --config cpu --frames 2000
  .venv/bin/python testing/soak.py --config emu-a --artifact QCOM_ARTIFACT_DIR --frames 2000
  .venv/bin/python testing/soak.py --config emu-b --artifact QCOM_ARTIFACT_DIR --frames 2000 --seconds 1200   # level B, 1 Hz

QCOM_ARTIFACT_DIR: `modeld-msm compile --vision V --policy P --camera 1928x1208 --device QCOM -o DIR` (captured on the emulated
node, any Linux box). emu-a runs it at level A (submissions only, nothing computed), emu-b at level B (the IR3 code executed).
Level B steps the tiny model in ~0.6 s, and modeld, like openpilot's, only prepares (warps) a frame that follows a dropped
one: fed at 20 Hz it would drop a frame during every step and never evaluate the model again. So emu-b offers a frame every
--period-ms (default 1000 for emu-b, 50 otherwise; the scene still advances 50 ms per frame id). The table reports frames
offered (camera frame ids spanned), published and the drop ratio. --seconds bounds a run by time as well as by --frames.

Sampled for modeld: VmRSS, private memory (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) and its anonymous part,
open fds, threads; for the run: /dev/shm entries under the run's OPENPILOT_PREFIX and in all of /dev/shm. On EMU, modeld
runs under a wrapper (this file with --modeld-child) that reports the emulated node's GEM handles, BO memory held, jobs in
flight and BOs they pin, and faults (hangs counted, page faults logged) to a side file every second.

modeld always runs under that wrapper, which also reports the heap: glibc's mallinfo2 (bytes malloc has handed out, bytes free
inside its heap) and Python's allocated block count; --trim-s n makes it call malloc_trim every n seconds, --garbage lists
the reference cycles it would leave behind (modeld runs with the cyclic collector off and collects between frames itself).

Slope is a least-squares fit over the second half of the samples (after warm-up), per 1000 frames. Read growth from anon KB
(the heap): private KB also counts pages of memfds (GEM BOs, VisionIPC buffers) whenever only modeld maps them at that
moment, so it swings by tens of MB between samples (measured on EMU level A: 180 <-> 217 MB) and its slope is noise.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from selfdrive_glue.files import write_atomic

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def proc_sample(pid: int) -> dict:
  out: dict = {}
  for ln in open(f"/proc/{pid}/status"):
    k, _, v = ln.partition(":")
    if k == "VmRSS":
      out["rss_kb"] = int(v.split()[0])
    elif k == "Threads":
      out["threads"] = int(v)
  priv = 0
  for ln in open(f"/proc/{pid}/smaps_rollup"):
    p = ln.split()
    if p[0] in ("Private_Clean:", "Private_Dirty:"):
      priv += int(p[1])
    elif p[0] == "Anonymous:":
      out["anon_kb"] = int(p[1])
  out["private_kb"] = priv
  fds = os.listdir(f"/proc/{pid}/fd")
  out["fds"] = len(fds)
  gem = 0
  for fd in fds:
    try:
      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:msm-bo"):
        gem += 1
    except OSError:
      pass
  out["gem_fds"] = gem
  return out


def shm_entries(prefix: str) -> tuple[int, int]:
  mine = f"/dev/shm/msgq_{prefix}"
  return (len(os.listdir(mine)) if os.path.isdir(mine) else 0), len(os.listdir("/dev/shm"))


def slope_per_1000(frames: list[int], values: list[float]) -> float:
  h = len(frames) // 2
  x, y = np.asarray(frames[h:], float), np.asarray(values[h:], float)
  if len(x) < 2 or np.ptp(x) == 0:
    return float("nan")
  return float(np.polyfit(x, y, 1)[0] * 1000)


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                                             "fordblks", "keepcost")]


def heap_sample(libc) -> dict:
  """What the C heap holds (glibc's mallinfo2: bytes handed out and bytes free inside it) and Python's live small blocks:
  anon growth with both flat is memory the allocator keeps, not memory anything holds."""
  out = {"py_blocks": sys.getallocatedblocks()}
  if libc is not None:
    m = libc.mallinfo2()
    out.update({"malloc_used_kb": (m.uordblks + m.hblkhd) // 1024, "malloc_free_kb": m.fordblks // 1024,
                "malloc_heap_kb": (m.arena + m.hblkhd) // 1024})
  return out


def _libc():
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
  except (OSError, AttributeError):   # not glibc, or one older than 2.33
    return None


def _write_garbage(path: str, seconds: float, top: int = 15) -> None:
  """Unreachable objects (reference cycles) that built up since the last census, by type: modeld disables the cyclic
  collector, so these are never freed. Collects them (once per census) and lists what they were."""
  import collections
  import gc
  gc.set_debug(gc.DEBUG_SAVEALL)
  n = gc.collect()
  kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
  # where the cycles' functions were defined: a hint to the code that builds them
  sites = collections.Counter(f"{o.__code__.co_filename}:{o.__code__.co_firstlineno}" for o in gc.garbage if hasattr(o, "__code__"))
  gc.garbage.clear()
  gc.set_debug(0)
  lines = [f"{n} unreachable objects in {seconds:.0f} s"] + [f"  {c:7d} {k}" for k, c in kinds.most_common(top)]
  lines += [f"  {c:7d} functions from {site}" for site, c in sites.most_common(5)]
  with open(path, "a") as f:
    f.write("\n".join(lines) + "\n")


def modeld_child(argv: list[str], stats_file: str) -> int:
  """modeld's own main() with a thread reporting the heap's facts and, on EMU, the emulated render node's counters to a side
  file every second (tests/bench only). SOAK_TRIM_S=n also returns the heap's free memory to the kernel every n seconds
  (glibc malloc_trim), to tell memory the allocator keeps from memory something holds; SOAK_GARBAGE=1 lists, every minute,
  the reference cycles modeld's disabled collector would leave (see _write_garbage)."""
  import backend.emu as emu
  nodes: list = []
  orig = emu.RenderNode.__init__

  def init(self, *a, **kw):
    orig(self, *a, **kw)
    nodes.append(self)
  emu.RenderNode.__init__ = init  # type: ignore[method-assign]
  libc = _libc()
  trim_s = float(os.environ.get("SOAK_TRIM_S", "0"))
  census = os.environ.get("SOAK_GARBAGE") == "1"

  def report():
    last_trim = t0 = time.monotonic()
    while True:
      time.sleep(1.0)
      if census and time.monotonic() - t0 > 60:   # modeld runs with gc disabled, like openpilot: what would a collection find?
        _write_garbage(stats_file + ".garbage.txt", time.monotonic() - t0)
        t0 = time.monotonic()
      if trim_s and libc is not None and time.monotonic() - last_trim >= trim_s:
        libc.malloc_trim(0)
        last_trim = time.monotonic()
      d = heap_sample(libc)
      if nodes:
        n = nodes[-1]
        ring = list(n._ring)   # one C-level copy under the GIL: modeld's thread may be retiring jobs meanwhile
        d.update({"gem_handles": n.live_handles, "bo_mem_kb": n.mem_used // 1024, "jobs_in_flight": len(ring),
                  "bos_in_flight": sum(len(j.bos) for j in ring), "faults_counted": len(n.stats.reported),
                  "page_faults": n.stats.page_faults, "vm_mappings": len(n.user_vm)})
      write_atomic(stats_file, json.dumps(d))
  threading.Thread(target=report, daemon=True).start()
  from modeld_msm import modeld
  sys.argv = ["modeld", *argv]
  return modeld.main()


def run(config: str, frames: int, artifact: Path | None, sample_s: float, out: Path | None, seconds_max: float | None = None,
        period_ms: float | None = None) -> dict:
  prefix = f"soak{uuid.uuid4().hex[:6]}"
  os.environ["OPENPILOT_PREFIX"] = prefix
  from offcar.demo import cached_artifact
  from selfdrive_glue import messaging
  if config == "cpu":
    art = artifact or cached_artifact("tiny", "1928x1208", "CPU", log=lambda *_: None)
    env_dev = {"DEV": "CPU"}
  else:
    if artifact is None:
      raise SystemExit("--artifact QCOM_DIR is needed for EMU configs (modeld-msm compile --device QCOM)")
    art = artifact
    # MODELD_DEV is what the artifact loader opens (artifact/load.py activate_target); EMU only when asked for by name
    env_dev = {"MODELD_DEV": "EMU+QCOM:IR3", "DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1" if config == "emu-b" else "0"}
  stats_file = f"/tmp/{prefix}-node.json"
  env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_dev}
  logdir = out or Path(f"/tmp/{prefix}")
  logdir.mkdir(parents=True, exist_ok=True)
  mlog, clog = open(logdir / "modeld.log", "w"), open(logdir / "camera.log", "w")
  margs = ["--artifact", str(art), "--demo"]
  cmd = [sys.executable, __file__, "--modeld-child", stats_file, "--", *margs]
  modeld = subprocess.Popen(cmd, env=env, stdout=mlog, stderr=subprocess.STDOUT, cwd=REPO)
  sm = messaging.SubMaster(["modelV2"], poll="modelV2")
  camera = None
  samples: list[dict] = []
  got = 0
  fids: list[int] = []   # first and last camera frame id modeld answered: the frames offered in between
  t_start = time.monotonic()
  try:
    # the camera starts once modeld has loaded, so the soak's frames are all offered to a running modeld
    period_ms = period_ms or (1000.0 if config == "emu-b" else 50.0)
    seconds = frames * period_ms / 1000 if seconds_max is None else min(frames * period_ms / 1000, seconds_max)
    camera = subprocess.Popen([sys.executable, "-m", "offcar.demo_camera", "--camera", "1928x1208", "--seconds", str(seconds + 180),
                               "--period-ms", str(period_ms)], env=env, stdout=clog, stderr=subprocess.STDOUT, cwd=REPO)
    first = None
    next_sample = 0.0
    from tqdm import tqdm
    bar = tqdm(total=frames, unit="frame", desc=f"soak {config}", file=sys.stderr, mininterval=10, smoothing=0.05)
    deadline = time.monotonic() + 600 + seconds * 2
    while got < frames and time.monotonic() < deadline and (seconds_max is None or first is None or time.monotonic() - first < seconds_max):
      sm.update(100)
      if sm.updated["modelV2"]:
        got += 1
        bar.update(1)
        fids[1:] = [int(sm["modelV2"].frameId)]
        if first is None:
          first = time.monotonic()
          fids = [int(sm["modelV2"].frameId)]
      if modeld.poll() is not None:
        break
      if first is not None and time.monotonic() >= next_sample:
        s = {"frames": got, "t": time.monotonic() - first, **proc_sample(modeld.pid)}
        s["shm_prefix"], s["shm_all"] = shm_entries(prefix)
        try:
          s.update(json.load(open(stats_file)))
        except (OSError, ValueError):
          pass
        samples.append(s)
        bar.set_postfix(anon_mb=f"{s.get('anon_kb', 0) / 1024:.1f}", fds=s.get("fds"), refresh=False)
        next_sample = time.monotonic() + sample_s
    bar.close()
  finally:
    if camera is not None:
      camera.terminate()
      camera.wait(10)
    rc_sent = modeld.poll()
    if rc_sent is None:
      modeld.send_signal(2)
      try:
        modeld.wait(30)
      except subprocess.TimeoutExpired:
        modeld.kill()
        modeld.wait()
    sm.close()
  wall = time.monotonic() - t_start
  garbage = Path(stats_file + ".garbage.txt")
  offered = fids[-1] - fids[0] + 1 if fids else 0
  return {"config": config, "frames": got, "asked": frames, "offered": offered, "drop_ratio": 1 - got / offered if offered else float("nan"),
          "wall_s": wall, "modeld_exit": modeld.returncode, "samples": samples, "logdir": str(logdir),
          "garbage": garbage.read_text() if garbage.exists() else None}


METRICS = [("rss_kb", "RSS KB"), ("private_kb", "private KB"), ("anon_kb", "anon KB"), ("fds", "open fds"), ("threads", "threads"),
           ("shm_prefix", "/dev/shm msgq (run)"), ("shm_all", "/dev/shm entries"), ("gem_fds", "GEM memfds"),
           ("gem_handles", "GEM handles"), ("bo_mem_kb", "BO memory KB"), ("vm_mappings", "VM_BIND mappings"), ("bos_in_flight", "BOs in flight"),
           ("jobs_in_flight", "jobs in flight"), ("faults_counted", "GPU faults counted"), ("page_faults", "page faults logged"),
           ("malloc_used_kb", "malloc in use KB"), ("malloc_free_kb", "malloc free KB"), ("malloc_heap_kb", "malloc heap KB"),
           ("py_blocks", "Python blocks")]


def table(r: dict) -> str:
  s = r["samples"]
  lines = [f"{r['config']}: {r['frames']}/{r['asked']} frames published in {r['wall_s']:.0f} s, {len(s)} samples, modeld exit {r['modeld_exit']}; "
           f"camera frames offered meanwhile {r['offered']}, dropped {r['drop_ratio']:.1%}"]
  lines.append(f"  {'resource':<22} {'start':>10} {'end':>10} {'slope/1000 frames':>18}")
  for k, name in METRICS:
    pts = [(x["frames"], x[k]) for x in s if k in x]
    if len(pts) < 2:
      continue
    f, v = zip(*pts, strict=True)
    lines.append(f"  {name:<22} {v[0]:>10} {v[-1]:>10} {slope_per_1000(list(f), list(v)):>18.1f}")
  if r.get("garbage"):
    lines.append("  reference cycles found each minute (--garbage):\n    " + r["garbage"].rstrip().replace("\n", "\n    "))
  return "\n".join(lines)


def main() -> int:
  if len(sys.argv) > 2 and sys.argv[1] == "--modeld-child":
    return modeld_child(sys.argv[4:], sys.argv[2])
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", choices=["cpu", "emu-a", "emu-b"], action="append", help="default: cpu")
  ap.add_argument("--frames", type=int, default=2000, help="frames to offer (an hours-long soak: 10,000; 2,000 is ~100 s at 20 Hz)")
  ap.add_argument("--artifact", type=Path, help="QCOM artifact for emu-a/emu-b (CPU: the demo's cached tiny artifact)")
  ap.add_argument("--sample-s", type=float, default=2.0)
  ap.add_argument("--seconds", type=float, help="stop after this many seconds of publishing too (level B does not keep 20 Hz)")
  ap.add_argument("--period-ms", type=float, help="wall time between camera frames (default: 1000 for emu-b, else 50)")
  ap.add_argument("--json", type=Path, help="write the samples here")
  ap.add_argument("--trim-s", type=float, default=0, help="modeld returns the C heap's free memory to the kernel every n s (malloc_trim): "
                  "run once with and once without to tell memory the allocator keeps from memory something holds")
  ap.add_argument("--garbage", action="store_true", help="every minute, modeld collects the reference cycles its disabled collector "
                  "left behind and writes what they were to <side file>.garbage.txt (the run's samples then include those collections)")
  args = ap.parse_args()
  if args.trim_s:
    os.environ["SOAK_TRIM_S"] = str(args.trim_s)
  if args.garbage:
    os.environ["SOAK_GARBAGE"] = "1"
  results = []
  for c in args.config or ["cpu"]:
    r = run(c, args.frames, args.artifact if c != "cpu" else None, args.sample_s, None, args.seconds, args.period_ms)
    results.append(r)
    print(table(r), flush=True)
  if args.json:
    args.json.write_text(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
