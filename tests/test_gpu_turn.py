"""The GPU turn modeld and dmonitoringmodeld share (modeld_msm/gpu_turn.py): the follower holds its chunks back while the
lead's frame is in flight, and no stale mark (a lead killed mid-frame, a flag left set) holds it for longer than its bounds.
The lead is a real second process over the shared page; the follower's chunk loop is the MSM interface's pump."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from backend import chunking, msm
from backend import uapi as u
from modeld_msm import gpu_turn
from tests.conftest import REPO

LONG_MS = 20_000.0   # bounds no test run reaches: only the behaviour under test ends a wait

# a lead in its own process, driven line by line: "begin HOLD_MS", "end", "pid"
LEAD = textwrap.dedent("""
  import sys
  from modeld_msm import gpu_turn
  lead = gpu_turn.Lead(gpu_turn.Page(sys.argv[1]))
  for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "begin":
      lead.hold_ns = int(float(arg[0]) * 1e6)
      lead.begin()
    elif cmd == "end":
      lead.end()
    print(cmd, gpu_turn.Page(sys.argv[1]).seq, flush=True)
""")


class LeadProcess:
  def __init__(self, path):
    self.p = subprocess.Popen([sys.executable, "-c", LEAD, str(path)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def say(self, line: str) -> int:
    assert self.p.stdin is not None and self.p.stdout is not None
    self.p.stdin.write(line + "\n")
    self.p.stdin.flush()
    cmd, seq = self.p.stdout.readline().split()
    assert cmd == line.split()[0]
    return int(seq)

  def close(self):
    if self.p.poll() is None:
      self.p.kill()
    self.p.wait()


@pytest.fixture
def page(tmp_path):
  pg = gpu_turn.Page(str(tmp_path / "turn"))
  yield pg
  pg.close()


def waiting(f: gpu_turn.Follower) -> tuple[threading.Thread, list[str]]:
  out: list[str] = []
  t = threading.Thread(target=lambda: out.append(f.wait_turn()), daemon=True)
  t.start()
  return t, out


def test_follower_yields_until_the_lead_frame_ends_and_a_stuck_flag_is_bounded(page):
  lead = LeadProcess(page.path)
  try:
    f = gpu_turn.Follower(page, chunk_wait_ms=LONG_MS, frame_wait_ms=LONG_MS, stale_ms=LONG_MS)
    assert f.wait_turn() == "free"
    assert lead.say(f"begin {LONG_MS}") & 1                 # modeld's frame in flight
    t, out = waiting(f)
    t.join(0.3)
    assert t.is_alive() and not out                        # the DM's next chunk is held back...
    assert lead.say("end") % 2 == 0
    t.join(10)
    assert out == ["turn"]                                 # ...until the lead's frame ends (a futex wake)
    assert f.wait_turn() == "free" and page.body()[3] == 1

    # a flag left set by a live lead: its own promise (hold) ends the wait, and that mark is not waited for again
    stuck = lead.say("begin 200")
    assert f.wait_turn() == "stale" and f.wait_turn() == "free" and page.seq == stuck
    lead.say("end")
    # a lead that promises too much: the follower's own staleness cap
    g = gpu_turn.Follower(page, chunk_wait_ms=LONG_MS, frame_wait_ms=LONG_MS, stale_ms=200)
    lead.say(f"begin {LONG_MS}")
    assert g.wait_turn() == "stale"
    # per chunk and per frame: a DM frame waits at most frame_wait in all, however many chunks it has
    h = gpu_turn.Follower(page, chunk_wait_ms=150, frame_wait_ms=200, stale_ms=LONG_MS)
    with h.frame():
      assert [h.wait_turn() for _ in range(4)] == ["chunk bound", "frame bound", "frame bound", "frame bound"]
      assert h.frame_left_ns <= 0
    with h.frame():                                        # the next DM frame has its budget again
      assert h.wait_turn() == "chunk bound"
    lead.say("end")
    assert h.wait_turn() == "free"
  finally:
    lead.close()


def test_a_lead_killed_mid_frame_does_not_hold_the_follower(page):
  lead = LeadProcess(page.path)
  try:
    f = gpu_turn.Follower(page, chunk_wait_ms=LONG_MS, frame_wait_ms=LONG_MS, stale_ms=LONG_MS)
    assert lead.say(f"begin {LONG_MS}") & 1
    t, out = waiting(f)
    t.join(0.2)
    assert t.is_alive()
    lead.p.kill()                                          # SIGKILL mid-frame: the mark stays up, nobody ends it
    lead.p.wait()
    t.join(10)
    assert out == ["dead"] and page.seq & 1
    assert f.wait_turn() == "free"                         # that mark is skipped from now on
  finally:
    lead.close()
  gpu_turn.Lead(page)                                      # the restarted modeld takes the dead lead's mark down
  assert page.seq % 2 == 0


def test_the_lead_marks_from_its_first_chunk_to_its_last_retire_and_only_inside_a_frame(page):
  lead = gpu_turn.Lead(page)
  lead.on_submit()
  assert page.seq % 2 == 0                                # start-up and warm-up submits mark nothing
  with lead.frame():
    assert page.seq % 2 == 0                              # the frame's CPU work before its GPU work: not marked
    lead.on_submit()
    lead.on_submit()
    first = page.seq
    assert first & 1 and page.body()[0] == os.getpid()    # up at the first chunk, once
    lead.on_idle()
    assert page.seq == first + 1                          # down once every chunk retired: the parse after it is CPU only
    lead.on_submit()
    assert page.seq == first + 2                          # a later graph of the same frame marks again
  assert page.seq == first + 3 and page.body()[3] == 2    # and the frame's end takes any mark down
  lead.on_idle()
  assert page.seq == first + 3


def test_the_chunk_loop_asks_before_every_submit_and_only_then(monkeypatch):
  """MSMIface.pump (every chunk given to the kernel) calls the gate before each submit, not while the ring is full."""
  calls: list[str] = []
  it = msm.MSMIface.__new__(msm.MSMIface)
  it.settings = msm.Settings(2, 16, 2, 10, 1000)
  it.vm_bind, it.pending, it.inflight, it.recent = True, collections.deque(), collections.deque(), collections.deque()
  it.stats = collections.Counter()
  it._cmd, it._no_table = u.drm_msm_gem_submit_cmd(), (msm.ctypes.c_char * 1)()
  it._submit = u.drm_msm_gem_submit()

  def submit():
    calls.append("submit")
    it._submit.fence = len(calls)
  monkeypatch.setattr(it, "_submit_ioctl", submit)
  cmd = msm.GemBuffer(1, 4096, 0x1000, 0)
  monkeypatch.setattr(chunking, "_gate", lambda: calls.append("gate"))
  for _ in range(3):
    it.enqueue(msm.Job(cmd, 0, 64, bytearray(), 1, []))
  assert calls == ["gate", "submit", "gate", "submit"] and len(it.pending) == 1   # the third waits for a free slot
  it.inflight.popleft()
  it.pump()
  assert calls[-2:] == ["gate", "submit"] and not it.pending


def test_switch_and_foreign_page(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv(gpu_turn.ENV_SWITCH, "0")
  assert isinstance(gpu_turn.for_role("follow", str(tmp_path / "a")), gpu_turn.Off) and not (tmp_path / "a").exists()
  monkeypatch.delenv(gpu_turn.ENV_SWITCH)
  assert isinstance(gpu_turn.for_role("lead", str(tmp_path / "a")), gpu_turn.Lead)
  (tmp_path / "b").write_bytes(b"not ours" * 512)
  assert isinstance(gpu_turn.for_role("follow", str(tmp_path / "b")), gpu_turn.Off)   # refused, left as it was, the DM runs on
  assert (tmp_path / "b").read_bytes() == b"not ours" * 512 and "running without yielding" in caplog.text
  monkeypatch.setenv(gpu_turn.ENV_PATH, str(tmp_path / "c"))
  assert gpu_turn.default_path() == str(tmp_path / "c")
  try:
    monkeypatch.delenv("MSM_INFLIGHT", raising=False)
    assert isinstance(gpu_turn.serve_turn("follow"), gpu_turn.Follower) and chunking._gate is not None
    assert os.environ["MSM_INFLIGHT"] == str(gpu_turn.FOLLOWER_INFLIGHT)   # the follower's chunks one at a time...
    monkeypatch.setenv("MSM_INFLIGHT", "3")
    gpu_turn.serve_turn("follow")
    assert os.environ["MSM_INFLIGHT"] == "3"                                # ...unless the user said otherwise
    lead = gpu_turn.serve_turn("lead")
    assert isinstance(lead, gpu_turn.Lead) and chunking._gate == lead.on_submit and chunking._idle == lead.on_idle
    monkeypatch.setenv(gpu_turn.ENV_SWITCH, "off")
    assert isinstance(gpu_turn.serve_turn("lead"), gpu_turn.Off) and chunking._gate is None and chunking._idle is None
  finally:
    chunking.set_submit_gate(None)
    chunking.set_idle_hook(None)
