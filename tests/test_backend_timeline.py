"""The a630 timeline model: one ring in order, no preemption, drm_sched priorities, a 60 Hz compositor beside a 20 Hz model."""
from backend import timeline as tl


def test_cost_model_grows_with_work_and_bytes():
  base = tl.dispatch_us(1e6, 1e5)
  assert tl.dispatch_us(1e9, 1e5) > base and tl.dispatch_us(1e6, 1e8) > base and base >= tl.DISPATCH_OVERHEAD_US
  prog = tl.full_size_program(n_kernels=300, seed=1)
  assert len(prog) == 300 and all(t >= tl.DISPATCH_OVERHEAD_US for t in prog)


def test_compositor_waits_at_most_the_jobs_already_in_the_ring():
  prog = tl.full_size_program()
  for chunk, inflight in ((16, 1), (64, 2)):
    r = tl.simulate(prog, tl.Policy("x", 2, chunk, inflight), seconds=5)
    worst_chunk_ms = max(sum(prog[i:i + chunk]) for i in range(0, len(prog), chunk)) / 1e3 + tl.SUBMIT_OVERHEAD_US / 1e3
    assert r.compositor_wait_max_ms <= inflight * worst_chunk_ms + 1.2 * tl.COMPOSITOR_US / 1e3   # plus one compositor job ahead of it
    assert r.model_frames > 0


def test_one_submit_per_graph_starves_the_compositor_and_chunks_do_not():
  prog = tl.full_size_program()
  stock, ours = tl.sweep(prog, tl.STOCK, seconds=5, phases=4), tl.sweep(prog, tl.DEFAULTS, seconds=5, phases=4)
  assert stock.compositor_wait_max_ms > sum(prog) / 1e3 * 0.8
  assert ours.misses_per_s < stock.misses_per_s and ours.compositor_wait_max_ms < stock.compositor_wait_max_ms / 3
  assert ours.model_max_ms < tl.MODEL_PERIOD_US / 1e3   # the model still fits its 50 ms frame


def test_priority_only_reorders_jobs_waiting_for_the_ring():
  prog = tl.full_size_program()
  # with few jobs in flight the ring never fills, so the queue priority changes nothing
  a, b = tl.simulate(prog, tl.Policy("lo", 2, 64, 2), 5), tl.simulate(prog, tl.Policy("hi", 0, 64, 2), 5)
  assert (a.vsync_misses, a.model_p50_ms) == (b.vsync_misses, b.model_p50_ms)
  # a flood of tiny model jobs fills the 8-slot ring; then a lower model priority lets the compositor in first
  lo, hi = tl.simulate(prog, tl.Policy("lo", 2, 8, 64), 5), tl.simulate(prog, tl.Policy("hi", 0, 8, 64), 5)
  assert lo.compositor_wait_max_ms < hi.compositor_wait_max_ms


def test_executed_cost_grows_with_each_kind_of_work():
  base = tl.executed_us(1e6, 0, 0, 1e4)
  assert base >= tl.DISPATCH_OVERHEAD_US
  assert tl.executed_us(1e9, 0, 0, 1e4) > base and tl.executed_us(1e6, 1e8, 0, 1e4) > base
  assert tl.executed_us(1e6, 0, 1e8, 1e4) > base and tl.executed_us(1e6, 0, 0, 1e9) > base
  # a quarter-rate SFU instruction costs four ALU ones
  assert abs((tl.executed_us(0, 1e8, 0, 0) - tl.DISPATCH_OVERHEAD_US) - 4 * (tl.executed_us(1e8, 0, 0, 0) - tl.DISPATCH_OVERHEAD_US)) < 1e-6


def test_chunks_by_time_bound_the_compositor_wait_by_the_budget():
  prog = tl.full_size_program(seed=3)
  budget = 2500.0
  chunks = tl.chunk_by_time(prog, budget)
  assert [x for c in chunks for x in c] == prog
  assert all(sum(c) <= budget or len(c) == 1 for c in chunks)
  r = tl.simulate(prog, tl.Policy("t", 2, 0, 1, chunk_us=budget), seconds=5)
  longest = max(sum(c) for c in chunks) + tl.SUBMIT_OVERHEAD_US
  assert r.compositor_wait_max_ms <= longest / 1e3 + 1.2 * tl.COMPOSITOR_US / 1e3


def _two(yields: bool, budget: float = 2500.0):
  drive, dm = tl.full_size_program(seed=4), tl.full_size_program(n_kernels=120, gflop=0.6, weight_mb=8, act_mb=20, seed=5)
  pol = tl.Policy("t", 2, 0, 1, chunk_us=budget)
  return [tl.Client("modeld", tuple(drive), pol), tl.Client("dm", tuple(dm), pol, yield_to="modeld" if yields else None)]


def test_one_client_shared_is_the_single_model_simulation():
  prog = tl.full_size_program(seed=6)
  one = tl.simulate_shared([tl.Client("m", tuple(prog), tl.DEFAULTS)], 5, seed=2, phase_us=300.0)
  single = tl.simulate(prog, tl.DEFAULTS, 5, seed=2, phase_us=300.0)
  assert one.models["m"].latencies_ms == single.latencies_ms and one.vsync_misses == single.vsync_misses


def test_two_models_each_get_every_frame_and_slow_each_other():
  clients = _two(yields=False)
  shared = tl.sweep_shared(clients, seconds=5, phases=3)
  for c in clients:
    alone = tl.sweep_shared([tl.Client(c.name, c.program_us, c.policy)], seconds=5, phases=3).models[c.name]
    r = shared.models[c.name]
    assert r.model_frames >= alone.model_frames - 3 and r.model_frames > 0   # both still at 20 Hz
    assert r.model_p99_ms >= alone.model_p99_ms   # sharing never makes a model faster
  assert shared.models["modeld"].model_p99_ms > tl.sweep_shared(clients[:1], seconds=5, phases=3).models["modeld"].model_p99_ms


def test_a_model_that_yields_gives_the_other_its_unshared_time():
  free = tl.sweep_shared(_two(yields=False), seconds=5, phases=3).models
  polite = tl.sweep_shared(_two(yields=True), seconds=5, phases=3).models
  alone = tl.sweep_shared(_two(False)[:1], seconds=5, phases=3).models["modeld"]
  assert polite["modeld"].model_p99_ms < free["modeld"].model_p99_ms
  # only a chunk the yielding model had in the ring when modeld's frame arrived can still delay it (and a compositor job
  # more, which that shift can let into modeld's frame)
  longest_dm_chunk = max(sum(c) for c in tl.chunk_by_time(list(_two(True)[1].program_us), 2500.0)) + tl.SUBMIT_OVERHEAD_US
  assert polite["modeld"].model_p99_ms <= alone.model_p99_ms + (longest_dm_chunk + tl.COMPOSITOR_US) / 1e3 + 1e-6
  assert polite["dm"].model_p50_ms >= free["dm"].model_p50_ms   # the price is paid by the one that yields


def test_a_bounded_yield_caps_the_follower_wait_per_frame():
  """The car's DM waits at most yield_frame_us per frame (modeld_msm/gpu_turn.py): bounded, the DM's frame is shorter
  than unbounded, and it never waits past the lead's frame end either (so it is never shorter than not yielding at all
  would allow for modeld)."""
  drive, dm = _two(yields=True)
  bounded = [drive, tl.Client(dm.name, dm.program_us, dm.policy, yield_to="modeld", yield_chunk_us=40_000, yield_frame_us=5_000)]
  hold = tl.sweep_shared(_two(yields=True), seconds=5, phases=3).models
  cap = tl.sweep_shared(bounded, seconds=5, phases=3).models
  free = tl.sweep_shared(_two(yields=False), seconds=5, phases=3).models
  assert cap["dm"].model_p99_ms < hold["dm"].model_p99_ms
  assert hold["modeld"].model_p99_ms <= cap["modeld"].model_p99_ms <= free["modeld"].model_p99_ms + 1e-6


def test_ui_rate_sets_the_compositor_jobs_and_the_trace_holds_every_job():
  prog = tl.full_size_program(seed=7)
  trace60: list = []
  trace20: list = []
  c = [tl.Client("m", tuple(prog), tl.Policy("t", 2, 0, 1, chunk_us=2500.0))]
  tl.simulate_shared(c, 2, seed=1, trace=trace60)
  tl.simulate_shared(c, 2, seed=1, ui_hz=20, trace=trace20)
  comp60, comp20 = (sum(1 for *_, who in tr if who == "compositor") for tr in (trace60, trace20))
  assert comp60 == 120 and comp20 == 40
  assert all(a < b for a, b, _ in trace60) and all(b1 <= a2 + 1e-6 for (_, b1, _), (a2, _, _) in zip(trace60, trace60[1:]))   # one ring
