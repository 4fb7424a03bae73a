"""`modeld-msm replay --engine ray`: the tasks of `replay_many` on Ray actors, resumable and tolerant of dying workers.

- One actor per worker holds a `Replayer`, so the artifact is loaded once per actor and serves every task it gets.
- At most `in_flight` tasks per actor are submitted at a time (one running, the next queued), so the driver and the
  object store never hold thousands of pending tasks; only small results travel through Ray, logs go straight to disk.
- Outputs are keyed by content (`replay_store`): a task whose outputs are finished for the same inputs, artifact, code
  and options returns their recorded results without replaying; the actor checks this itself, so hashing the segments
  is spread over the workers.
- A worker that dies (killed, out of memory, a crash in native code) is restarted by Ray, which runs its queued tasks
  again on the new process (`max_task_retries`); outputs are written atomically, so a task run twice writes the same
  bytes once. A task that kills its worker on every try ends as that segment's error, like any other bad segment.

- GPU artifacts (CUDA, NV, AMD): each actor asks Ray for `gpus_per_actor` of a GPU (default 1/ACTORS_PER_GPU), so Ray
  packs 1/F replayers onto each GPU and sets CUDA_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES on AMD nodes) per actor. tinygrad's
  CUDA runtime honours that; its NV and AMD runtimes open the GPUs directly and ignore it, so those actors are pointed at
  their GPU through MODELD_DEV (tinygrad's device indices) instead. CPU artifacts ask `num_cpus=1` and no GPU.

Every path sent to a worker is absolute: on a cluster the segments, the artifact and OUT must be at the same paths on
every node (a shared filesystem), and the nodes need this package and its pinned tinygrad installed.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from offcar import replay_store as store
from offcar.replay import MODES, WARMUP_STEPS, Replayer, ReplayResult, _error_result, _run_task, output_paths, plan_tasks
from selfdrive_glue.errors import UserError
from selfdrive_glue.route import Segment

TASK_RETRIES = 2  # tries after the first when the worker running a task dies
IN_FLIGHT = 2  # tasks per actor: one running, one queued so the actor never waits on the driver
GPU_DEVICES = ("CUDA", "NV", "AMD")  # artifact devices that replay on a workstation/cluster GPU
HCQ_DEVICES = ("NV", "AMD")  # tinygrad runtimes that open the GPUs themselves and ignore CUDA_/HIP_VISIBLE_DEVICES
# Replayers per GPU when --gpus-per-actor is not given. One replayer leaves an H200 mostly idle: it spends its time on
# HEVC decode and messages on the CPU, not in the 2 ms GPU step; 4 processes per GPU doubled the rate, 8 added nothing on
# a 16-core host (docs/gpu.md). Each actor also takes one CPU, so CPUs per node bound this as well.
ACTORS_PER_GPU = 4


def artifact_device(artifact: str | os.PathLike) -> str:
  """The device an artifact (or every artifact of a release bundle) was compiled for, from its metadata (no hashing: the
  worker verifies the artifact when it loads it)."""
  p = Path(artifact)
  metas = [p / "metadata.json"] if (p / "metadata.json").is_file() else sorted(p.glob("*/metadata.json"))
  if not metas:
    raise UserError(f"artifact {p} has no metadata.json; pass an artifact directory (modeld-msm compile -o DIR) or a release bundle")
  devices = set()
  for m in metas:
    try:
      devices.add(str(json.loads(m.read_text())["device"]))
    except (OSError, ValueError, KeyError, TypeError):
      raise UserError(f"artifact {p}: {m.name} is unreadable or names no device; rebuild it with `modeld-msm compile`") from None
  if len(devices) > 1:
    raise UserError(f"artifact bundle {p} mixes devices ({', '.join(sorted(devices))}); replay needs one device per run")
  return devices.pop()


def gpu_fraction(device: str, gpus_per_actor: float | None) -> float:
  """--gpus-per-actor for an artifact's device -> the `num_gpus` each actor asks Ray for (0: a CPU actor)."""
  gpu = device in GPU_DEVICES
  if gpus_per_actor is None:
    return 1 / ACTORS_PER_GPU if gpu else 0.0
  if not math.isfinite(gpus_per_actor) or not 0 <= gpus_per_actor <= 1:
    raise UserError(f"--gpus-per-actor must be between 0 and 1 (a replayer drives one GPU; 0.25 packs 4 per GPU), got {gpus_per_actor}")
  if gpu and gpus_per_actor == 0:
    raise UserError(f"the artifact is for {device}, so its actors need a GPU: pass --gpus-per-actor > 0 "
                    f"(default {1 / ACTORS_PER_GPU:g} = {ACTORS_PER_GPU} per GPU), or replay a CPU artifact")
  if not gpu and gpus_per_actor > 0:
    raise UserError(f"--gpus-per-actor {gpus_per_actor:g} but the artifact is for {device}, not a GPU that Ray places actors on "
                    f"({', '.join(GPU_DEVICES)}); drop it, or compile an artifact for a GPU (`modeld-msm compile --device "
                    f"{'|'.join(GPU_DEVICES)}`)")
  return float(gpus_per_actor)


def actor_options(device: str, gpus_per_actor: float | None = None) -> dict[str, Any]:
  """The ray.remote options of a replay actor for an artifact of `device`: one CPU (decode and messages run there in every
  case), the GPU fraction for GPU artifacts, restarted when its process dies, its queued tasks retried."""
  opts: dict[str, Any] = {"num_cpus": 1, "max_restarts": -1, "max_task_retries": TASK_RETRIES}
  frac = gpu_fraction(device, gpus_per_actor)
  if frac:
    opts["num_gpus"] = frac
  return opts


def actor_capacity(cpus: float, gpus: float, frac: float) -> int:
  """How many actors of one CPU and `frac` of a GPU the cluster can hold at once. A fractional actor lives on one GPU,
  so each whole GPU holds floor(1/frac) of them (0.3 -> 3 per GPU, not 3.33)."""
  n = int(cpus)
  if frac > 0:
    n = min(n, int(gpus + 1e-9) * int(1 / frac + 1e-9))
  return n


def hcq_target(load_target: str, gpu_ids: list[Any]) -> str | None:
  """The tinygrad device string that limits an NV/AMD artifact to the GPUs Ray gave this actor (MODELD_DEV, read when
  the artifact is loaded); None where nothing needs changing (CUDA honours CUDA_VISIBLE_DEVICES, CPU has no GPU, or
  the target already names its devices)."""
  from tinygrad.helpers import Target
  t = Target.parse(load_target)
  if t.device not in HCQ_DEVICES or not gpu_ids or t.indices:
    return None
  return repr(replace(t, indices=",".join(str(i) for i in gpu_ids)))


def run_stored_task(replayer: Replayer, task, mode: str, warmup_steps: int, resume: bool) -> list[tuple[ReplayResult, bool]]:
  """One task on one worker -> [(result, already done)]. Finished outputs for the same key are returned, not replayed;
  a route task is replayed whole unless all its segments are done (each one starts from the state the one before left)."""
  try:
    keys = store.task_keys(task, replayer.artifact, mode, warmup_steps)
  except (UserError, OSError) as e:
    return [(_error_result(s, o, e if isinstance(e, UserError) else UserError(f"{s.path}: {e}")), False) for s, o, _ in task]
  if resume:
    done = [store.done_result(o, k) for (_, o, _), k in zip(task, keys)]
    if all(d is not None for d in done):
      return [(d, True) for d in done]
  results = _run_task(replayer, task, mode, warmup_steps)
  for (seg, out, _), key, r in zip(task, keys, results):
    if r.error is None:
      store.write_meta(out, key, seg, r, mode, replayer.artifact)
  return [(r, False) for r in results]


class ReplayWorker:
  """The body of a Ray actor (wrapped with ray.remote at run time, so importing this module never needs Ray)."""

  def __init__(self, artifact: str, device: str):
    if device in HCQ_DEVICES and not os.environ.get("MODELD_DEV"):  # before the artifact opens its device
      import ray
      if (target := hcq_target(device, ray.get_gpu_ids())) is not None:
        os.environ["MODELD_DEV"] = target
    self.replayer = Replayer(artifact)

  def where(self) -> tuple[int, list[str], str | None]:
    """(pid, the GPU ids Ray gave this actor, CUDA_VISIBLE_DEVICES as this process sees it)."""
    import ray
    return os.getpid(), [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")

  def run(self, task, mode: str, warmup_steps: int, resume: bool) -> tuple[int, list[tuple[ReplayResult, bool]]]:
    try:
      return os.getpid(), run_stored_task(self.replayer, task, mode, warmup_steps, resume)
    except UserError as e:  # the artifact itself was refused: every segment of the task gets the error, as with --jobs
      self.replayer = Replayer(self.replayer.artifact)
      return os.getpid(), [(_error_result(s, o, e), False) for s, o, _ in task]


@dataclass
class RayRun:
  results: list[ReplayResult]  # in the order of the segments given
  done_before: int  # segments whose outputs were already finished for the same key (not replayed)
  restarts: int  # worker processes seen replaced after dying
  workers: int
  address: str
  gpus_per_actor: float = 0.0  # each actor's share of a GPU (0: CPU actors)
  gpu_ids: list[list[str]] | None = None  # per actor, the GPU ids Ray assigned it at start


def _import_ray():
  try:
    import ray
  except ImportError:
    raise UserError("--engine ray needs the ray package; install it with `pip install -e .` in this checkout (it is a dependency) "
                    "or `pip install ray`") from None
  return ray


def _connect(ray, address: str | None, jobs: int | None) -> bool:
  """Join a cluster (address or $RAY_ADDRESS), else start a private local one; -> whether we started it."""
  if ray.is_initialized():
    return False
  address = address or os.environ.get("RAY_ADDRESS") or None
  kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
  try:
    if address:
      ray.init(address=address, **kw)
    else:  # --jobs above the core count oversubscribes, as the local engine does
      ray.init(address="local", num_cpus=max(os.cpu_count() or 1, jobs or 1), include_dashboard=False, **kw)
  except ConnectionError as e:
    raise UserError(f"cannot reach the Ray cluster at {address}: {e}; start one (`ray start --head`) or check --address") from None
  return not address


def _first_line(e: BaseException) -> str:
  s = str(e).strip().splitlines()
  return s[0] if s else type(e).__name__


def replay_ray(segments: list[Segment], artifact: str | os.PathLike, out: str | os.PathLike, jobs: int | None = None, address: str | None = None,
               progress: bool = True, mode: str = "segment", warmup_steps: int = WARMUP_STEPS, resume: bool = True, in_flight: int = IN_FLIGHT,
               on_result: Callable[[int, int, list[tuple[ReplayResult, bool]]], None] | None = None,
               gpus_per_actor: float | None = None) -> RayRun:
  """replay_many's tasks on `jobs` Ray actors (default: as many as the cluster holds: one per CPU, and for a GPU artifact
  at most 1/gpus_per_actor per GPU). gpus_per_actor: each actor's share of a GPU (default 1/ACTORS_PER_GPU for GPU
  artifacts, none for CPU ones). on_result(actor index, its pid, results) is called after each task (tests use it to kill
  a worker mid-run)."""
  from tqdm import tqdm
  if mode not in MODES:
    raise UserError(f"unknown replay mode '{mode}'; use one of {', '.join(MODES)}")
  if warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {warmup_steps}")
  if jobs is not None and jobs < 1:
    raise UserError(f"--jobs must be >= 1, got {jobs}")
  segments = [Segment(Path(s.path).resolve()) for s in segments]  # workers need not share the driver's working directory
  artifact = str(Path(artifact).resolve())
  device = artifact_device(artifact)
  opts = actor_options(device, gpus_per_actor)  # refuses a GPU share for a CPU artifact (and none for a GPU one) before Ray starts
  frac = float(opts.get("num_gpus", 0.0))
  outs = output_paths(segments, Path(out).resolve())
  for o in outs:
    o.parent.mkdir(parents=True, exist_ok=True)
  tasks = plan_tasks(segments, outs, mode)
  ray = _import_ray()
  started = _connect(ray, address, jobs)
  try:
    res = ray.cluster_resources()
    cpus, gpus = int(res.get("CPU", 0)), float(res.get("GPU", 0))
    if frac and gpus < 1:
      raise UserError(f"artifact {artifact} is for {device} but the Ray cluster has no GPU; join one with GPUs (--address) "
                      "or replay a CPU artifact")
    cap = actor_capacity(cpus, gpus, frac)
    if jobs is not None and jobs > cap:  # an actor that never fits would hold its tasks forever
      gpu_part = f" and {gpus:g} GPU(s) at {frac:g} GPU per worker" if frac else ""
      raise UserError(f"--jobs {jobs} but the Ray cluster has {cpus} CPU(s){gpu_part}, room for {cap} worker(s), so "
                      f"{jobs - cap} would never start; pass --jobs {max(cap, 1)} or fewer" + (" or a smaller --gpus-per-actor" if frac else ""))
    n = max(1, min(jobs or cap, len(tasks)))
    actor_cls = ray.remote(**opts)(ReplayWorker)
    actors = [actor_cls.remote(artifact, device) for _ in range(n)]
    placed = ray.get([a.where.remote() for a in actors])
    pids = [p for p, _, _ in placed]
    order = {s.path: i for i, s in enumerate(segments)}
    results: list[ReplayResult | None] = [None] * len(segments)
    pending = deque(range(len(tasks)))
    inflight: dict[Any, tuple[int, int]] = {}  # ref -> (actor, task)
    load = [0] * n
    done_before = restarts = 0
    with tqdm(total=len(segments), desc=f"replay (ray, {n} worker{'s' if n > 1 else ''})", unit="segment", disable=not progress) as bar:
      while pending or inflight:
        for i in range(n):
          while load[i] < in_flight and pending:
            t = pending.popleft()
            inflight[actors[i].run.remote(tasks[t], mode, warmup_steps, resume)] = (i, t)
            load[i] += 1
        ready, _ = ray.wait(list(inflight), num_returns=1)
        for ref in ready:
          i, t = inflight.pop(ref)
          load[i] -= 1
          try:
            pid, rs = ray.get(ref)
            if pid != pids[i]:
              restarts += 1
              pids[i] = pid
          except ray.exceptions.RayActorError as e:  # its worker died on every try
            why = f"the Ray worker replaying it died {TASK_RETRIES + 1} times ({_first_line(e)}); replay this segment alone to see why"
            rs = [(_error_result(s, o, UserError(f"{s.name}: {why}")), False) for s, o, _ in tasks[t]]
          except ray.exceptions.RayError as e:  # a bug, not a bad input: reported per segment so the rest of the batch finishes
            cause = getattr(e, "cause", None) or e
            rs = [(_error_result(s, o, UserError(f"{s.name}: replay crashed: {type(cause).__name__}: {_first_line(cause)}")), False)
                  for s, o, _ in tasks[t]]
          for (s, _, _), (r, before) in zip(tasks[t], rs):
            results[order[s.path]] = r
            done_before += before
          bar.update(len(rs))
          bar.set_postfix(done_before=done_before, restarts=restarts, refresh=False)
          if on_result is not None:
            on_result(i, pids[i], rs)
    addr = ray.get_runtime_context().gcs_address
    for o in outs:  # what a killed worker was writing (LogWriter's temp file); every task of this run has finished
      for stale in o.parent.glob(f".{o.name}.*.tmp"):
        stale.unlink(missing_ok=True)
  finally:
    if started:
      ray.shutdown()
  return RayRun([r for r in results if r is not None], done_before, restarts, n, addr, frac, [g for _, g, _ in placed])
