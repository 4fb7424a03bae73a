"""A GPU timeline model of the a630 under mainline msm: one ring, no preemption, drm_sched ordering by priority.

Cost model (figures from docs/anchors.md §2-4):
  dispatch_us = DISPATCH_OVERHEAD_US + max(flops / (PEAK_FLOPS * EFFICIENCY), bytes / (DRAM_BYTES_PER_S * BW_EFFICIENCY))
  - PEAK_FLOPS 345.6 GFLOPS: measured fp16/fp32 MAD peak with the 64-thread waves tinygrad's QCOM queue uses (THREAD64).
  - DRAM 29.9 GB/s (LPDDR4X-3733, 4x16 bit), shared with CPU/camera/display: taken at 50 %.
  - EFFICIENCY 0.37 and 5 us per dispatch (CP_WAIT_FOR_IDLE + flush + state load around every CP_EXEC_CS) make the 0.11
    driving_vision program (1.62 GFLOP, ~885 launches) come out at the 17 ms tinygrad's CI asserts on a comma device.
  - Each GEM_SUBMIT adds SUBMIT_OVERHEAD_US on the GPU (kernel-inserted IB + fence write); after a retire the CPU needs
    CPU_WAKE_US to notice and push the next chunk (WAIT_FENCE wake-up + our submit path).
Cost from execution (emulator level B counts each dispatch's work as the a630 would issue it):
  executed_us = DISPATCH_OVERHEAD_US + max(alu/ALU_RATE + sfu/SFU_RATE over ISSUE_EFFICIENCY, bytes / DRAM share, texels / TEX_RATE)
  - ALU_RATE 172.8 G lane-instructions/s: one MAD per lane per cycle at the peak above; the counts hold every issued cat1-3
    instruction (address math and moves too), so they are taken at ISSUE_EFFICIENCY 0.8 rather than the FLOP-based 0.37.
  - SFU at a quarter of the ALU rate; texel fetches at 2 TPs x 4 texels/clock x 710 MHz, served by the texture caches
    (a convolution re-reads its weights and input rows, so texels are not DRAM traffic); ldg/stg bytes go to DRAM.
The compositor is a client submitting one COMPOSITOR_US job per vsync at a higher priority; a vsync is missed when its job
has not finished by the next vsync. drm_sched pushes a job into the ring as soon as the ring has a free slot
(num_hw_submissions = 8), highest priority first; the ring itself runs in order.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, cast

PEAK_FLOPS = 345.6e9
EFFICIENCY = 0.37
DRAM_BYTES_PER_S = 29.9e9
BW_EFFICIENCY = 0.5
DISPATCH_OVERHEAD_US = 5.0
SUBMIT_OVERHEAD_US = 20.0
CPU_WAKE_US = 60.0
RING_SLOTS = 8
VSYNC_US = 1e6 / 60
COMPOSITOR_US = 5000.0
COMPOSITOR_PRIO = 0
MODEL_PERIOD_US = 50_000.0


def dispatch_us(flops: float, nbytes: float) -> float:
  return DISPATCH_OVERHEAD_US + max(flops / (PEAK_FLOPS * EFFICIENCY), nbytes / (DRAM_BYTES_PER_S * BW_EFFICIENCY)) * 1e6


ALU_RATE = PEAK_FLOPS / 2
SFU_RATE = ALU_RATE / 4
TEX_RATE = 2 * 4 * 710e6
ISSUE_EFFICIENCY = 0.8


def executed_us(alu: float, sfu: float, texels: float, nbytes: float) -> float:
  """a630 time of one dispatch from the work level B executed (fiber-instructions, texel fetches, bytes moved)."""
  compute = (alu / ALU_RATE + sfu / SFU_RATE) / ISSUE_EFFICIENCY
  memory = nbytes / (DRAM_BYTES_PER_S * BW_EFFICIENCY)
  return DISPATCH_OVERHEAD_US + max(compute, memory, texels / TEX_RATE) * 1e6


def chunk_by_time(program_us: list[float], budget_us: float) -> list[list[float]]:
  """Consecutive dispatches grouped so that each group's estimated GPU time stays within budget_us (a longer single
  dispatch is a group of its own): the compositor then waits at most about one budget."""
  chunks: list[list[float]] = []
  cur: list[float] = []
  for us in program_us:
    if cur and sum(cur) + us > budget_us:
      chunks.append(cur)
      cur = []
    cur.append(us)
  if cur:
    chunks.append(cur)
  return chunks


def full_size_program(n_kernels: int = 885, gflop: float = 1.69, weight_mb: float = 60.0, act_mb: float = 60.0, seed: int = 0) -> list[float]:
  """Per-dispatch durations (us) of a model the size of openpilot's vision+policy (anchors §3): n_kernels launches whose FLOPs and
  bytes are spread log-normally (a few big convolutions, many small elementwise kernels)."""
  rng = random.Random(seed)
  w = [rng.lognormvariate(0, 1.5) for _ in range(n_kernels)]
  b = [rng.lognormvariate(0, 1.0) for _ in range(n_kernels)]
  sw, sb = sum(w), sum(b)
  return [dispatch_us(gflop * 1e9 * x / sw, (weight_mb + act_mb) * 1e6 * y / sb) for x, y in zip(w, b)]


@dataclass(frozen=True)
class Policy:
  name: str
  prio: int            # submitqueue priority of the model (0 highest)
  chunk_kernels: int   # 0: one submit per graph
  inflight: int
  chunk_us: float = 0.0   # > 0: chunk by estimated GPU time instead of kernel count


@dataclass(frozen=True)
class Result:
  policy: Policy
  seconds: float
  vsync_misses: int
  model_frames: int
  model_p50_ms: float
  model_max_ms: float
  compositor_wait_max_ms: float
  latencies_ms: tuple[float, ...] = field(default=(), repr=False)   # every model frame's latency, sorted (pooled by sweep)

  @property
  def misses_per_s(self) -> float:
    return self.vsync_misses / self.seconds

  @property
  def model_p99_ms(self) -> float:
    return self.latencies_ms[min(len(self.latencies_ms) - 1, int(0.99 * len(self.latencies_ms)))] if self.latencies_ms else 0.0


@dataclass(frozen=True)
class Client:
  """A model process sharing the GPU: its per-frame dispatches, its submit policy (each process has its own submitqueue),
  where its camera frames land (offset_us after the first client's) and, with yield_to, another client's name whose frame
  in progress holds back this one's next chunk (a chunk already submitted still runs). The hold is bounded as the car's
  (modeld_msm/gpu_turn.py): at most yield_chunk_us before one chunk and yield_frame_us over one frame (0: unbounded)."""
  name: str
  program_us: tuple[float, ...]
  policy: Policy
  offset_us: float = 0.0
  yield_to: str | None = None
  yield_chunk_us: float = 0.0
  yield_frame_us: float = 0.0


@dataclass(frozen=True)
class SharedResult:
  seconds: float
  vsync_misses: int
  compositor_wait_max_ms: float
  models: dict[str, Result]   # per client: its frames, p50/max and latencies (the shared misses and UI wait repeated)

  @property
  def misses_per_s(self) -> float:
    return self.vsync_misses / self.seconds


def _chunks(program_us, policy: Policy) -> list[float]:
  if policy.chunk_us > 0:
    chunks = chunk_by_time(list(program_us), policy.chunk_us)
  else:
    step = policy.chunk_kernels if policy.chunk_kernels > 0 else len(program_us)
    chunks = [list(program_us[i:i + step]) for i in range(0, len(program_us), step)]
  return [SUBMIT_OVERHEAD_US + sum(c) for c in chunks]


def simulate_shared(clients: list[Client], seconds: float = 30.0, compositor_us: float = COMPOSITOR_US, seed: int = 0,
                    phase_us: float = 0.0, ui_hz: float = 60.0, trace: list | None = None) -> SharedResult:
  """Every client's model at 20 Hz beside the compositor, on one in-order ring fed by drm_sched. Camera and display clocks
  are independent: phase_us sets where camera frames land relative to vsync; frames jitter by +-1 ms (seeded). The UI
  draws at ui_hz (a divisor of 60: one compositor job every 60/ui_hz vsyncs, each due at the next vsync). trace, if given,
  receives every GPU job as (start_us, end_us, owner): "compositor" or the client's name."""
  rng = random.Random(seed)
  names = [c.name for c in clients]
  chunk_us = [_chunks(c.program_us, c.policy) for c in clients]
  end_t = seconds * 1e6
  events: list[tuple[float, int, str, object]] = []
  seq = 0

  def at(t, kind, data=None):
    nonlocal seq
    heapq.heappush(events, (t, seq, kind, data))
    seq += 1

  waiting: list[tuple[int, int, tuple]] = []   # drm_sched: (prio, arrival order, job)
  ring: list[tuple] = []
  gpu_busy = False
  state: list[dict[str, Any]] = [{"next_chunk": 0, "inflight": 0, "start": None, "queued": 0, "held": None, "yield_left": 0.0}
                                 for _ in clients]
  latencies: list[list[float]] = [[] for _ in clients]
  comp_waits: list[float] = []
  misses = 0

  def push_ready(t):
    nonlocal gpu_busy
    while waiting and len(ring) < RING_SLOTS:
      ring.append(heapq.heappop(waiting)[2])
    if not gpu_busy and ring:
      job = ring[0]
      gpu_busy = True
      if job[0] == "comp":
        comp_waits.append(t - job[2])
      if trace is not None:
        trace.append((t, t + job[1], "compositor" if job[0] == "comp" else names[job[4]]))
      at(t + job[1], "gpu_done")

  def submit(t, job, prio):
    nonlocal seq
    heapq.heappush(waiting, (prio, seq, job))
    seq += 1
    push_ready(t)

  def held(t, ci) -> bool:
    """Whether the other model's frame in progress holds this client's next chunk back now (within the bounds)."""
    m, c = state[ci], clients[ci]
    busy = c.yield_to is not None and state[names.index(c.yield_to)]["start"] is not None
    if not busy:
      if m["held"] is not None:
        m["yield_left"] -= t - m["held"]
        m["held"] = None
      return False
    if m["held"] is None:
      m["held"] = t
      bounds = [b for b in (c.yield_chunk_us, m["yield_left"] if c.yield_frame_us > 0 else 0.0) if b > 0]
      if bounds:
        at(t + max(min(bounds), 0.0), "unhold", ci)
    waited = t - m["held"]
    if (c.yield_chunk_us > 0 and waited >= c.yield_chunk_us) or (c.yield_frame_us > 0 and waited >= m["yield_left"]):
      m["yield_left"] -= waited   # a bound reached: this chunk goes
      m["held"] = None
      return False
    return True

  def pump(t, ci):
    m, c = state[ci], clients[ci]
    while m["start"] is not None and m["next_chunk"] < len(chunk_us[ci]) and m["inflight"] < c.policy.inflight:
      if held(t, ci):
        return
      i = m["next_chunk"]
      m["next_chunk"] += 1
      m["inflight"] += 1
      submit(t, ("model", chunk_us[ci][i], t, i == len(chunk_us[ci]) - 1, ci), c.policy.prio)

  def frame(t, ci):
    m = state[ci]
    if m["start"] is not None:   # still running the last frame: this camera frame waits
      m["queued"] += 1
      return
    m.update(start=t, next_chunk=0, held=None, yield_left=clients[ci].yield_frame_us)
    pump(t, ci)

  for ci, c in enumerate(clients):
    k = 0
    while k * MODEL_PERIOD_US < end_t:
      # a camera frame arrives; 3 ms of CPU preprocessing before the first submit
      at(k * MODEL_PERIOD_US + phase_us + c.offset_us + 3000.0 + rng.uniform(-1000, 1000), "frame", ci)
      k += 1
  k, every = 0, max(1, round(60.0 / ui_hz))
  while k * VSYNC_US < end_t:
    if k % every == 0:
      at(k * VSYNC_US + 1000.0, "comp", k * VSYNC_US + VSYNC_US)   # the UI submits ~1 ms after vsync; due at the next one
    k += 1
  while events:
    t, _, kind, data = heapq.heappop(events)
    if kind == "frame":
      frame(t, cast(int, data))
    elif kind == "comp":
      submit(t, ("comp", compositor_us, t, data), COMPOSITOR_PRIO)
    elif kind == "gpu_done":
      job = ring.pop(0)
      gpu_busy = False
      if job[0] == "comp" and t > job[3]:
        misses += 1
      if job[0] == "model":
        at(t + CPU_WAKE_US, "model_retired", (job[4], job[3]))
      push_ready(t)
    elif kind == "unhold":
      ci = cast(int, data)
      if state[ci]["held"] is not None:
        pump(t, ci)
    elif kind == "model_retired":
      ci, last = cast(tuple[int, bool], data)
      m = state[ci]
      m["inflight"] -= 1
      if last:
        latencies[ci].append(t - m["start"])
        m["start"] = None
        if m["queued"]:
          m["queued"] -= 1
          frame(t, ci)
      pump(t, ci)
      for cj, c in enumerate(clients):   # a model held back by this one may go on
        if last and c.yield_to == clients[ci].name:
          pump(t, cj)
  wait_ms = max(comp_waits) / 1e3 if comp_waits else 0.0
  models = {}
  for c, lat in zip(clients, latencies):
    lat.sort()
    models[c.name] = Result(c.policy, seconds, misses, len(lat), lat[len(lat) // 2] / 1e3 if lat else 0.0, lat[-1] / 1e3 if lat else 0.0,
                            wait_ms, tuple(x / 1e3 for x in lat))
  return SharedResult(seconds, misses, wait_ms, models)


def simulate(program_us: list[float], policy: Policy, seconds: float = 30.0, compositor_us: float = COMPOSITOR_US, seed: int = 0,
             phase_us: float = 0.0) -> Result:
  """One model at 20 Hz beside the compositor at 60 Hz (simulate_shared with one client)."""
  return simulate_shared([Client("model", tuple(program_us), policy)], seconds, compositor_us, seed, phase_us).models["model"]


def sweep_shared(clients: list[Client], seconds: float = 20.0, phases: int = 10, compositor_us: float = COMPOSITOR_US,
                 ui_hz: float = 60.0) -> SharedResult:
  """simulate_shared() over camera/vsync phases spread across one vsync period (the clocks drift against each other)."""
  rs = [simulate_shared(clients, seconds, compositor_us, seed=i, phase_us=VSYNC_US * i / phases, ui_hz=ui_hz) for i in range(phases)]
  models = {}
  for c in clients:
    per = [r.models[c.name] for r in rs]
    lat = sorted(r.model_p50_ms for r in per)
    models[c.name] = Result(c.policy, seconds * phases, sum(r.vsync_misses for r in rs), sum(r.model_frames for r in per), lat[len(lat) // 2],
                            max(r.model_max_ms for r in per), max(r.compositor_wait_max_ms for r in rs),
                            tuple(sorted(x for r in per for x in r.latencies_ms)))
  return SharedResult(seconds * phases, sum(r.vsync_misses for r in rs), max(r.compositor_wait_max_ms for r in rs), models)


def sweep(program_us: list[float], policy: Policy, seconds: float = 20.0, phases: int = 10) -> Result:
  """simulate() averaged over camera/vsync phases spread across one vsync period (the clocks drift against each other)."""
  rs = [simulate(program_us, policy, seconds, seed=i, phase_us=VSYNC_US * i / phases) for i in range(phases)]
  lat = sorted(r.model_p50_ms for r in rs)
  return Result(policy, seconds * phases, sum(r.vsync_misses for r in rs), sum(r.model_frames for r in rs), lat[len(lat) // 2],
                max(r.model_max_ms for r in rs), max(r.compositor_wait_max_ms for r in rs), tuple(sorted(x for r in rs for x in r.latencies_ms)))


DEFAULTS = Policy("ours: lowest prio, 64-kernel chunks, 2 in flight", 2, 64, 2)
STOCK = Policy("prio 0, one submit per graph (PR #17224)", 0, 0, 1)
