"""Replay throughput on CPU: frames/s for the tiny and full reference models, the speed-up of --jobs N, and the cost of
running the same N workers on Ray.

  .venv/bin/python bench/bench_replay.py [--segments 4] [--seconds 2] [--jobs 2] [--camera 1344x760]
                                          [--artifact-tiny DIR] [--artifact-full DIR | --no-full] [--no-ray] [--row-timeout 900]

Synthesises a short route (deterministic), then replays it: HEVC decode alone (the floor every run pays), then for the tiny
and the full model: serial, N jobs, and N Ray actors (`--engine ray`: once starting a private local cluster as the CLI
does, once on a cluster already up, as on a shared one). Artifacts not given are built (models + compile --device CPU)
into the cache the demo uses. Every ratio is against a peer measured in this run. Wall time includes worker start-up and
artifact loading, as a real batch would pay them. Outputs of every configuration are checked byte for byte.

Each configuration runs in a child process of its own, under --row-timeout, while this process samples the memory and
CPU time of the child's whole process tree (Ray's raylet and actors included) and the machine's MemAvailable. On a
machine shared with other jobs the wall times swing with their load; the CPU seconds a row used hardly do, so Ray's
overhead against --jobs N is given in both. A configuration that fails,
hangs or is killed becomes a FAILED row with its cause (exit status or signal, the child's last stderr lines, peak memory)
instead of ending the run: an earlier version measured every row in one process and printed the table only at the end,
so one failing row (a SystemExit from a replay error, an assert, or the process killed) discarded every row measured.
Rows are printed as they finish, and the table also when this process is interrupted.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STDERR_TAIL = 12  # lines of a failed child's stderr repeated on ours


def build_artifact(size: str, camera: str) -> Path:
  """The reference models compiled for CPU, from the cache `modeld-msm demo` and `replay` share (built once)."""
  from offcar.demo import cached_artifact
  return cached_artifact(size, camera, "CPU", log=lambda m: print(m, flush=True))


# ---- the child: one configuration, measured in-process; prints {"frames", "wall"} as its last stdout line ----

def decode_only(segments) -> tuple[int, float]:
  """Decode both camera files of every segment; counts frame pairs (what a model step consumes)."""
  from selfdrive_glue.route import ROAD_CAMERA, WIDE_CAMERA
  from selfdrive_glue.video import VideoReader
  t = time.perf_counter()
  pairs = 0
  for s in segments:
    counts = [sum(1 for _ in VideoReader(p).frames()) for p in (s.camera(ROAD_CAMERA), s.camera(WIDE_CAMERA)) if p is not None]
    pairs += counts[0]
  return pairs, time.perf_counter() - t


def timed_replay(segments, artifact: Path, jobs: int, out: Path) -> tuple[int, float]:
  from offcar.replay import replay_many
  t = time.perf_counter()
  res = replay_many(segments, artifact, out, jobs=jobs, progress=False)
  wall = time.perf_counter() - t
  if bad := [r.error for r in res if r.error]:
    raise SystemExit(f"replay failed: {bad[0]}")
  return sum(r.frames for r in res), wall


def timed_ray(segments, artifact: Path, workers: int, out: Path, cluster_up: bool) -> tuple[int, float]:
  """--engine ray with `workers` actors; cluster_up: the local cluster is started before the clock (not counted)."""
  import ray

  from offcar.replay_ray import replay_ray
  if cluster_up:
    ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING)
  try:
    t = time.perf_counter()
    run = replay_ray(segments, artifact, out, jobs=workers, progress=False)
    wall = time.perf_counter() - t
  finally:
    if cluster_up:
      ray.shutdown()
  if bad := [r.error for r in run.results if r.error]:
    raise SystemExit(f"replay --engine ray failed: {bad[0]}")
  if run.restarts:  # a retried task is paid twice: say so rather than report a slow row as Ray's overhead
    print(f"[bench] {run.restarts} Ray worker(s) died and were restarted during this row", file=sys.stderr, flush=True)
  return sum(r.frames for r in run.results), wall


def _become_subreaper() -> None:
  """Adopt orphaned descendants (Linux PR_SET_CHILD_SUBREAPER), so Ray's actors, whose raylet may exit before reaping
  them, are waited for by this process, and their CPU time reaches the parent's RUSAGE_CHILDREN."""
  import ctypes
  try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
  except (OSError, AttributeError):
    pass  # not Linux: the CPU column may then miss what orphans used


def _reap_all(deadline_s: float = 20.0) -> None:
  t = time.monotonic()
  while time.monotonic() - t < deadline_s:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return  # none left
    if pid == 0:
      time.sleep(0.1)


def child(args) -> int:
  from selfdrive_glue.route import expand_segments
  _become_subreaper()
  segs = expand_segments([str(args.route)])
  if args.row == "decode":
    n, wall = decode_only(segs)
  elif args.row == "local":
    n, wall = timed_replay(segs, args.artifact, args.jobs, args.out)
  else:
    n, wall = timed_ray(segs, args.artifact, args.jobs, args.out, cluster_up=args.row == "ray-up")
  print(json.dumps({"frames": n, "wall": wall}), flush=True)
  _reap_all()
  return 0


# ---- the parent: runs each configuration in a child, watches it, and keeps every row ----

@dataclass
class Row:
  name: str
  frames: int = 0
  wall: float = 0.0
  peak_mb: float = 0.0  # RSS of the child's process tree at its highest (Ray's processes included)
  avail_min_mb: float = 0.0  # the machine's lowest MemAvailable while it ran
  cpu_s: float = 0.0  # user + system CPU of the child and every descendant it waited for (incl. pre-clock cluster start)
  error: str | None = None
  note: str = ""
  out: Path | None = None

  @property
  def fps(self) -> float:
    return self.frames / self.wall if self.wall > 0 and not self.error else 0.0


def _tree_sample(root: int) -> tuple[float, dict[int, float]]:
  """(summed RSS in MB, {pid: CPU seconds so far}) of `root` and every descendant, following /proc/<pid>/task/<tid>/children
  (only the tree, not every process of the machine: a full /proc scan twice a second cost ~13 % of a core, which the rows
  then paid)."""
  page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
  rss, cpu = 0, {}
  todo, seen = [root], set()
  while todo:
    p = todo.pop()
    if p in seen:
      continue
    seen.add(p)
    try:
      rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
      fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
      cpu[p] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
      for t in Path(f"/proc/{p}/task").iterdir():
        todo += [int(c) for c in (t / "children").read_text().split()]
    except (OSError, ValueError, IndexError):
      continue  # the process ended while we looked, or this kernel has no children files (then: the root alone)
  return rss / 2**20, cpu


def _mem_available_mb() -> float:
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) / 1024
  except OSError:
    pass
  return 0.0


def run_row(name: str, argv: list[str], timeout: float, logdir: Path, out: Path | None = None) -> Row:
  """One configuration in a child process (own session, so a timeout can end all it started); -> its Row, failed or not."""
  row = Row(name, out=out)
  err_path = logdir / f"{len(list(logdir.iterdir())):02d}.stderr"
  print(f"[bench] {name} ...", file=sys.stderr, flush=True)
  import resource
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  with open(err_path, "w") as err:
    proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    t0 = time.monotonic()
    row.avail_min_mb = _mem_available_mb()
    timed_out = False
    seen_cpu: dict[int, float] = {}  # pid -> its CPU seconds when last sampled
    try:
      while proc.poll() is None:
        rss, cpu = _tree_sample(proc.pid)
        row.peak_mb = max(row.peak_mb, rss)
        for pid, c in cpu.items():
          seen_cpu[pid] = max(seen_cpu.get(pid, 0.0), c)
        row.avail_min_mb = min(row.avail_min_mb, _mem_available_mb())
        if time.monotonic() - t0 > timeout:
          timed_out = True
          break
        time.sleep(0.5)
    finally:  # timed out, or this process interrupted: end the group this child leads (Ray's processes it started too)
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    stdout = proc.communicate()[0]
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  # Two estimates, each short in its own way: the rusage of waited-for descendants is exact for --jobs (the pool's workers
  # are joined) but misses Ray processes nobody waited for; the samples see every process of the tree but lose what each
  # used in its last second. Take the larger.
  waited = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  row.cpu_s = max(waited, sum(seen_cpu.values()))
  tail = [ln for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()][-STDERR_TAIL:]
  result = next((json.loads(ln) for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
  mem = f"peak RSS {row.peak_mb:.0f} MB, MemAvailable down to {row.avail_min_mb:.0f} MB"
  if timed_out:
    row.error = f"timed out after {timeout:.0f} s (--row-timeout); {mem}"
  elif proc.returncode < 0:
    sig = signal.Signals(-proc.returncode).name
    why = " (out of memory? see dmesg)" if sig == "SIGKILL" else ""
    row.error = f"killed by {sig}{why}; {mem}"
  elif proc.returncode != 0 or result is None:
    row.error = f"exit status {proc.returncode}: {tail[-1] if tail else 'no stderr'}; {mem}"
  else:
    row.frames, row.wall = int(result["frames"]), float(result["wall"])
  if row.error:
    print(f"[bench] {name}: FAILED: {row.error}\n[bench] its stderr ({err_path}), last lines:", file=sys.stderr)
    for ln in tail:
      print(f"[bench]   | {ln}", file=sys.stderr)
  else:
    print(f"[bench] {name}: {row.frames} frames in {row.wall:.2f} s = {row.fps:.1f} frames/s, {row.cpu_s:.1f} CPU s ({mem})",
          file=sys.stderr, flush=True)
  return row


def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def ratio(a: Row | None, b: Row | None, what: str, time_overhead: bool = False) -> str:
  """a's speed against peer b, or a's wall time and CPU time per frame against b's, or why there is none. On a machine
  shared with other jobs the wall times swing with their load; the CPU time a row spent is much steadier."""
  if a is None or b is None or a.error or b.error or not a.fps or not b.fps:
    return f"n/a ({what} failed)" if b is not None and b.error else ""
  if time_overhead:
    cpu = f", {(a.cpu_s / a.frames) / (b.cpu_s / b.frames) - 1:+.1%} CPU" if a.cpu_s and b.cpu_s else ""
    return f"{b.fps / a.fps - 1:+.1%} wall{cpu} per frame vs {what}"
  return f"{a.fps / b.fps:.2f}x {what}"


def print_table(rows: list[Row], args) -> None:
  print(f"\nreplay on CPU: {args.segments} segments x {args.seconds:g} s at {args.camera}, {os.cpu_count()} CPUs visible: {cpu_model()}")
  print(f"{'configuration':<44} {'frames':>7} {'wall s':>8} {'frames/s':>9} {'CPU s':>7} {'peak MB':>8}  ratio")
  print("-" * 120)
  for r in rows:
    if r.error:
      print(f"{r.name:<44} {'-':>7} {'-':>8} {'-':>9} {r.cpu_s:>7.1f} {r.peak_mb:>8.0f}  FAILED: {r.error}")
    else:
      print(f"{r.name:<44} {r.frames:>7} {r.wall:>8.2f} {r.fps:>9.1f} {r.cpu_s:>7.1f} {r.peak_mb:>8.0f}  {r.note}")
  print("CPU s: user+system of the row's whole process tree, start-up included (Ray's cluster start too, even where the "
        "wall clock started after it); peak MB: the tree's RSS at its highest")
  sys.stdout.flush()


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--segments", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=2.0)
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--camera", default="1344x760")
  ap.add_argument("--artifact-tiny", type=Path)
  ap.add_argument("--artifact-full", type=Path)
  ap.add_argument("--no-full", action="store_true", help="skip the full model (its first compile takes a minute or more)")
  ap.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
  ap.add_argument("--row-timeout", type=float, default=900, metavar="S", help="seconds one configuration may take before it is "
                  "killed and reported as FAILED (default 900)")
  # one configuration, run as a child of the above (internal)
  ap.add_argument("--row", choices=("decode", "local", "ray-start", "ray-up"), help=argparse.SUPPRESS)
  ap.add_argument("--route", type=Path, help=argparse.SUPPRESS)
  ap.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
  ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.row:
    return child(args)
  if args.segments < 1 or args.seconds <= 0 or args.jobs < 1 or args.row_timeout <= 0:
    ap.error("--segments, --seconds, --jobs and --row-timeout must be positive")

  os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from a benchmark cluster
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM unwinds like Ctrl-C: the child is ended, the table printed
  from selfdrive_glue.synth import synth_route
  tiny = args.artifact_tiny or build_artifact("tiny", args.camera)
  full = None if args.no_full else (args.artifact_full or build_artifact("full", args.camera))
  rows: list[Row] = []
  with tempfile.TemporaryDirectory(prefix="bench-replay-") as td:
    tdp = Path(td)
    logs = tdp / "stderr"
    logs.mkdir()
    route = tdp / "route"
    synth_route(route, args.segments, args.seconds, 7, args.camera, qcamera=False, progress=False)

    def row(name: str, kind: str, artifact: Path | None, jobs: int, out: str | None) -> Row:
      argv = ["--row", kind, "--route", str(route), "--jobs", str(jobs)]
      if artifact is not None:
        argv += ["--artifact", str(artifact)]
      if out is not None:
        argv += ["--out", str(tdp / out)]
      r = run_row(name, argv, args.row_timeout, logs, tdp / out if out else None)
      rows.append(r)
      return r

    try:
      dec = row("HEVC decode only (road+wide)", "decode", None, 1, None)
      dec.note = "peer"
      for size, art in (("tiny", tiny), ("full", full)):
        if art is None:
          continue
        one = row(f"{size}, --jobs 1", "local", art, 1, f"{size}-1")
        one.note = ratio(one, dec, "decode") if size == "tiny" else ratio(one, next(r for r in rows if r.name == "tiny, --jobs 1"), "tiny --jobs 1")
        many = row(f"{size}, --jobs {args.jobs}", "local", art, args.jobs, f"{size}-j")
        many.note = ratio(many, one, f"{size} --jobs 1")
        if not args.no_ray:
          for label, kind in (("incl. cluster start", "ray-start"), ("cluster up", "ray-up")):
            r = row(f"{size}, ray {args.jobs} workers ({label})", kind, art, args.jobs, f"{size}-{kind}")
            r.note = ratio(r, many, f"{size} --jobs {args.jobs}", time_overhead=True)
        # same outputs whatever the job count or engine
        ref = rows[[r.name for r in rows].index(f"{size}, --jobs 1")]
        for r in rows:
          if r.out is not None and r is not ref and r.name.startswith(f"{size},") and not r.error and not ref.error:
            differ = [f.name for f in sorted(ref.out.glob("*.zst")) if f.read_bytes() != (r.out / f.name).read_bytes()] if ref.out else []
            if differ:
              r.error = f"outputs differ from {size} --jobs 1: {', '.join(differ)}"
    finally:  # also on Ctrl-C or a kill of this process: what was measured is printed
      print_table(rows, args)
  return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
