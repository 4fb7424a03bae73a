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

Every path sent to a worker is absolute: on a cluster the segments, the artifact and OUT must be at the same paths on
every node (a shared filesystem), and the nodes need this package and its pinned tinygrad installed.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeld_msm import replay_store as store
from modeld_msm.errors import UserError
from modeld_msm.replay import MODES, WARMUP_STEPS, Replayer, ReplayResult, _error_result, _run_task, output_paths, plan_tasks
from selfdrive_glue.route import Segment

TASK_RETRIES = 2  # tries after the first when the worker running a task dies
IN_FLIGHT = 2  # tasks per actor: one running, one queued so the actor never waits on the driver


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

  def __init__(self, artifact: str):
    self.replayer = Replayer(artifact)

  def pid(self) -> int:
    return os.getpid()

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


def _import_ray():
  try:
    import ray
  except ImportError:
    raise UserError("--engine ray needs the ray package; install it with `pip install -e .` in this checkout (it is a dependency) "
                    "or `pip install ray`") from None
  return ray


def _connect(ray, address: str | None, jobs: int | None) -> bool:
  """Join a cluster (address or $RAY_ADDRESS), else start a private local one; -> whether we started it."""
  import logging
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
               on_result: Callable[[int, int, list[tuple[ReplayResult, bool]]], None] | None = None) -> RayRun:
  """replay_many's tasks on `jobs` Ray actors (default: one per CPU of the cluster). on_result(actor index, its pid, results)
  is called after each task (tests use it to kill a worker mid-run)."""
  from tqdm import tqdm
  if mode not in MODES:
    raise UserError(f"unknown replay mode '{mode}'; use one of {', '.join(MODES)}")
  if warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {warmup_steps}")
  if jobs is not None and jobs < 1:
    raise UserError(f"--jobs must be >= 1, got {jobs}")
  segments = [Segment(Path(s.path).resolve()) for s in segments]  # workers need not share the driver's working directory
  artifact = str(Path(artifact).resolve())
  outs = output_paths(segments, Path(out).resolve())
  for o in outs:
    o.parent.mkdir(parents=True, exist_ok=True)
  tasks = plan_tasks(segments, outs, mode)
  ray = _import_ray()
  started = _connect(ray, address, jobs)
  try:
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if jobs is not None and jobs > cpus:
      raise UserError(f"--jobs {jobs} but the Ray cluster has {cpus} CPU(s), so {jobs - cpus} worker(s) would never start; "
                      f"pass --jobs {max(cpus, 1)} or fewer")
    n = max(1, min(jobs or cpus, len(tasks)))
    actor_cls = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=TASK_RETRIES)(ReplayWorker)
    actors = [actor_cls.remote(artifact) for _ in range(n)]
    pids = ray.get([a.pid.remote() for a in actors])
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
  return RayRun([r for r in results if r is not None], done_before, restarts, n, addr)
