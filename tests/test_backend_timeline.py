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
