"""The hand-off of a split kernel's parts to the worker cores, in C: the workers wait for work by spinning, then sleeping.

artifact/cpu_threads.py runs a kernel's THREAD parts on all cores. Its Python pool hands a part to a worker through a
semaphore, and the worker, asleep in the kernel, takes a cross-core wake-up to start it, the caller another to learn it
finished, which can cost far more than a small kernel itself, and a step runs about a hundred split kernels (the
measurements: docs/performance-cpu.md §5). Here the hand-off is a shared counter:
  * the caller writes the part's arguments into the worker's lane, bumps `go`, runs its own part, then watches `done`;
  * a worker watches `go`, runs its part, and sets `done`;
  * both watch by spinning for a bounded time, then sleep on a futex, so an idle process costs no CPU: a worker spins for
    200 us after its last part (the next kernel of a step comes within tens of us), the caller for 2 ms (a worker's
    part normally ends within its own). The first 20 us of a spin pause, the rest yield the core each turn, so a thread
    the scheduler put on the same core (the other side, when the process is not spread over the cores) is not held up
    for a time slice. Whoever bumps a counter wakes the other only when it sleeps (the flags and counters are
    sequentially consistent, so a sleeper never misses its wake-up).
Both sides run in C with the GIL released (ctypes drops it for each foreign call), so a spinning worker never holds up
the Python thread. Kernels get their arguments the way ctypes passed them before: every one as a 64-bit integer.

The library is built once per source with the system's clang (`clang` is already needed by tinygrad's CPU device) into
the user's cache directory, and loaded with ctypes; without clang, or on a platform it does not build on, cpu_threads
keeps its Python pool.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from backend import native_lib

MAX_ARGS = 32   # arguments a kernel may take through this pool (pointers and ints); more go through the Python pool
MAX_PARTS = 8   # parts one lane runs per kernel

_SOURCE = r"""
#include <stdint.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_ARGS %(max_args)d
#define MAX_PARTS %(max_parts)d
#define WORKER_SPIN_NS 200000L
#define CALLER_SPIN_NS 2000000L
#define PAUSE_NS 20000L

typedef struct {
  _Atomic uint32_t go, done, sleeping, waiting, stop;
  uint32_t nparts;
  uint64_t fn;
  uint64_t args[MAX_PARTS][MAX_ARGS];
  char pad[64];
} lane_t;

typedef void (*kernel_t)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                         uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

/* every argument slot is passed: a callee that takes fewer reads only its own (the caller owns the stack) */
static void call(uint64_t fn, const uint64_t* a) {
  ((kernel_t)fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
                 a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30], a[31]);
}

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void futex_wait(_Atomic uint32_t* w, uint32_t old) {
  struct timespec t = {0, 100000000L};   /* re-check every 100 ms: a lost wake-up would cost no more than that */
  syscall(SYS_futex, (uint32_t*)w, FUTEX_WAIT_PRIVATE, old, &t, 0, 0);
}

static void futex_wake(_Atomic uint32_t* w) { syscall(SYS_futex, (uint32_t*)w, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0); }

/* wait until *w != old: spin (pausing) for PAUSE_NS, then spin yielding the core until spin_ns (a thread the scheduler
   put on this core, the other side included, gets it), then sleep with *flag set */
static uint32_t await_change(_Atomic uint32_t* w, uint32_t old, _Atomic uint32_t* flag, long spin_ns, _Atomic uint32_t* stop) {
  long start = 0, t = 0;
  for (unsigned i = 0;; i++) {
    uint32_t v = atomic_load(w);
    if (v != old) return v;
    if (stop && atomic_load(stop)) return old;
    if ((i & 63) == 0) {
      t = now_ns();
      if (!start) start = t;
      if (t - start > spin_ns) {
        atomic_store(flag, 1);
        if (atomic_load(w) == old) futex_wait(w, old);
        atomic_store(flag, 0);
        start = 0;
        continue;
      }
    }
    if (t - start > PAUSE_NS) sched_yield();
    else relax();
  }
}

void modeld_pool_worker(lane_t* l) {
  uint32_t seen = 0;   /* not the current go: a part handed over before this thread got here must still run */
  for (;;) {
    uint32_t g = await_change(&l->go, seen, &l->sleeping, WORKER_SPIN_NS, &l->stop);
    if (g == seen) return;   /* stopped */
    seen = g;
    for (uint32_t p = 0; p < l->nparts; p++) call(l->fn, l->args[p]);
    atomic_store(&l->done, g);
    if (atomic_load(&l->waiting)) futex_wake(&l->done);
  }
}

/* parts: nparts rows of MAX_ARGS arguments; part p runs on lane p %% nlanes, lane 0 being the caller */
void modeld_pool_run(lane_t* lanes, uint32_t nlanes, uint64_t fn, const uint64_t* parts, uint32_t nparts) {
  uint32_t used = nparts < nlanes ? nparts : nlanes;
  for (uint32_t k = 1; k < used; k++) {
    lane_t* l = &lanes[k];
    uint32_t n = 0;
    for (uint32_t p = k; p < nparts; p += nlanes, n++)
      for (int a = 0; a < MAX_ARGS; a++) l->args[n][a] = parts[p * MAX_ARGS + a];
    l->nparts = n;
    l->fn = fn;
    atomic_fetch_add(&l->go, 1);
    if (atomic_load(&l->sleeping)) futex_wake(&l->go);
  }
  for (uint32_t p = 0; p < nparts; p += nlanes) call(fn, &parts[p * MAX_ARGS]);
  for (uint32_t k = 1; k < used; k++) {
    lane_t* l = &lanes[k];
    uint32_t g = atomic_load(&l->go), d;
    /* wait for a change from the value just compared: one loaded again could already be g, and would be waited out */
    while ((d = atomic_load(&l->done)) != g) await_change(&l->done, d, &l->waiting, CALLER_SPIN_NS, 0);
  }
}

void modeld_pool_stop(lane_t* l) {
  atomic_store(&l->stop, 1);
  futex_wake(&l->go);
}

unsigned long modeld_pool_lane_size(void) { return sizeof(lane_t); }
"""


def source() -> str:
  return _SOURCE % {"max_args": MAX_ARGS, "max_parts": MAX_PARTS}


def build(cache: Path | None = None) -> ctypes.CDLL:
  """The pool library, built with clang on first use (keyed by the source's sha256) and loaded. Raises OSError or
  subprocess.CalledProcessError when it cannot be built or loaded here."""
  dll = native_lib.build("cpu_pool", source(), cache=cache)
  dll.modeld_pool_worker.argtypes = [ctypes.c_void_p]
  dll.modeld_pool_run.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint32]
  dll.modeld_pool_stop.argtypes = [ctypes.c_void_p]
  dll.modeld_pool_lane_size.restype = ctypes.c_ulong
  return dll
