"""Fuzz the three readers modeld takes untrusted bytes from: SubMaster (msgq Events), LogReader (rlog/qlog files) and the
VisionIPC client (frame notifications over msgq, and the camera server's buffer reply over its unix socket).

Inputs are valid seeds mutated (bit flips, random bytes, truncation, garbage appended, segment tables and list counts
made huge, one service's Event sent as another) plus plain random bytes. A crash is anything the documented contract
does not allow:
- SubMaster.update_msgs never raises (bad messages are counted in `bad_messages`), and what it hands out can be read
  the way modeld reads it (the union member and the fields ModeldCore takes) without an exception;
- LogReader raises only UserError (an unreadable whole file); iterating never raises (`damage` says where it stopped),
  and each Event it yields gives its member;
- VisionIpcClient.connect returns True/False and recv returns a buffer or None, never raising, and a buffer it returns
  can be read in full (a mapping shorter than the descriptor claims would be a SIGBUS: a process death, not an exception);
- modeld's CarParams loader may raise anything (it logs and falls back to defaults), but must not abort the process;
- any input taking longer than HANG_S is a hang.

  .venv/bin/python testing/fuzz.py --inputs 5000 --seed 1

These are the readers' bytes; the values in well-formed messages (NaN, +-inf, negative, huge, the wrong union member)
sent to the two real model processes are testing/fuzz_values.py's.
"""
from __future__ import annotations

import argparse
import array
import os
import random
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HANG_S = 5.0


@dataclass
class Result:
  target: str
  tried: int = 0
  crashes: int = 0
  clean_errors: int = 0         # inputs refused the documented way (bad_messages, UserError, connect False, ...)
  examples: list[str] = field(default_factory=list)

  def crash(self, what: str) -> None:
    self.crashes += 1
    if len(self.examples) < 5:
      self.examples.append(what)


class Hang(Exception):
  pass


def _alarm(_sig, _frame):
  raise Hang(f"no answer within {HANG_S} s")


def guarded(res: Result, desc: str, fn: Callable[[], None]) -> None:
  """Run one input; an exception or a hang counts as a crash."""
  res.tried += 1
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.setitimer(signal.ITIMER_REAL, HANG_S)
  try:
    fn()
  except Exception as e:
    res.crash(f"{desc}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}\n{traceback.format_exc(limit=-3)}")
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


# ---- mutators -----------------------------------------------------------------------------------------------------------

def bitflip(rng: random.Random, b: bytes) -> bytes:
  if not b:
    return b"\x01"
  a = bytearray(b)
  for _ in range(rng.choice((1, 1, 2, 4, 8))):
    i = rng.randrange(len(a) * 8)
    a[i // 8] ^= 1 << (i % 8)
  return bytes(a)


def randbytes(rng: random.Random, b: bytes) -> bytes:
  if not b:
    return rng.randbytes(8)
  a = bytearray(b)
  for _ in range(rng.randint(1, 16)):
    a[rng.randrange(len(a))] = rng.randrange(256)
  return bytes(a)


def truncate(rng: random.Random, b: bytes) -> bytes:
  n = rng.randrange(len(b)) if b else 0
  return b[:n - n % 8] if rng.random() < 0.5 else b[:n]


def extend(rng: random.Random, b: bytes) -> bytes:
  return b + rng.randbytes(rng.choice((1, 7, 8, 64, 4096)))


def huge_count(rng: random.Random, b: bytes) -> bytes:
  """A 32-bit word made huge: the segment count or a segment size, or the count/size half of some pointer (list lengths)."""
  a = bytearray(b)
  if len(a) < 8:
    return b + rng.randbytes(8)
  pos = rng.choice([0, 4] + [rng.randrange(0, len(a) - 3) // 4 * 4 for _ in range(3)])
  if pos + 4 <= len(a):
    a[pos:pos + 4] = struct.pack("<I", rng.choice((0xFFFFFFFF, 0x7FFFFFFF, 0x1FFFFFFF, 1 << 24, len(a))))
  return bytes(a)


def random_input(rng: random.Random, b: bytes) -> bytes:
  return rng.randbytes(rng.choice((0, 1, 8, 16, 64, len(b), 4096)))


def splice(rng: random.Random, b: bytes, other: bytes) -> bytes:
  i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
  return b[:i] + other[j:]


MUTATORS = [bitflip, bitflip, randbytes, truncate, extend, huge_count, huge_count, random_input]


def mutate(rng: random.Random, b: bytes, corpus: list[bytes]) -> tuple[str, bytes]:
  if rng.random() < 0.1:
    return "splice", splice(rng, b, rng.choice(corpus))
  m = rng.choice(MUTATORS)
  out = m(rng, b)
  if rng.random() < 0.2:   # stack a second mutation
    out = rng.choice(MUTATORS)(rng, out)
  return m.__name__, out


# ---- SubMaster ----------------------------------------------------------------------------------------------------------

SM_SERVICES = ["roadCameraState", "wideRoadCameraState", "deviceState", "liveCalibration", "carState", "carControl", "liveDelay",
               "driverMonitoringState", "modelV2"]
# what ModeldCore reads of each service outside a try (core.on_frame, DesireHelper): these reads must never raise
CONSUMER_FIELDS = {"roadCameraState": ("frameId",), "carState": ("vEgo", "leftBlinker", "rightBlinker", "steeringPressed", "steeringTorque",
                                                                  "leftBlindspot", "rightBlindspot"),
                   "carControl": ("latActive",), "liveDelay": ("lateralDelay",), "driverMonitoringState": ("isRHD",)}
# ...and inside _update_transforms' try, where any exception is a counted bad input (an unknown enum value, a list of the
# wrong element type): read too, so a process-killing read would still show, but exceptions are allowed
GUARDED_FIELDS = {"roadCameraState": ("sensor",), "deviceState": ("deviceType",), "liveCalibration": ("rpyCalib",)}


def event_corpus() -> dict[str, bytes]:
  from selfdrive_glue import messaging
  out = {}
  for s in SM_SERVICES:
    e = messaging.new_message(s, valid=True)
    m = getattr(e, s)
    if s == "liveCalibration":
      m.rpyCalib = [0.01, -0.02, 0.03]
    elif s in ("roadCameraState", "wideRoadCameraState"):
      m.frameId, m.sensor = 1234, "ar0231"
    elif s == "deviceState":
      m.deviceType = "tici"
    elif s == "carState":
      m.vEgo, m.leftBlinker = 12.5, True
    elif s == "modelV2":
      m.frameId = 7
      pos = m.init("position")
      pos.x, pos.y, pos.z = [float(i) for i in range(33)], [0.5] * 33, [0.0] * 33
      ll = m.init("laneLines", 4)
      for i in range(4):
        ll[i].y = [float(i)] * 33
    elif s == "driverMonitoringState":
      m.isRHD = True
    out[s] = e.to_bytes()
  return out


def consume(member, service: str) -> None:
  for f in CONSUMER_FIELDS.get(service, ()):
    str(getattr(member, f))
  for f in GUARDED_FIELDS.get(service, ()):
    try:
      v = getattr(member, f)
      list(v) if f == "rpyCalib" else str(v)
    except Exception:
      pass


def fuzz_submaster(seed: int, n: int) -> Result:
  from selfdrive_glue import messaging
  res = Result("SubMaster")
  rng = random.Random(seed)
  corpus = event_corpus()
  raws = list(corpus.values())
  sm = messaging.SubMaster(SM_SERVICES, poll="roadCameraState")
  big = messaging.new_message("liveCalibration", valid=True)
  big.liveCalibration.rpyCalib = [1.0] * 100_000   # an oversized (but well-formed) list: modeld must refuse its shape, not SubMaster
  big_bytes = big.to_bytes()
  try:
    for i in range(n):
      svc = rng.choice(SM_SERVICES)
      kind = rng.random()
      if kind < 0.1:
        desc, dat = "wrong service", corpus[rng.choice([s for s in SM_SERVICES if s != svc])]
      elif kind < 0.13:
        desc, dat = "oversized list", big_bytes
        svc = "liveCalibration"
      else:
        desc, dat = mutate(rng, corpus[svc], raws)
      t = 1.0 + i * 0.05

      def one(svc=svc, dat=dat, t=t):
        before = sm.bad_messages
        sm.update_msgs(t, [(svc, dat)])
        if sm.bad_messages > before:
          res.clean_errors += 1
        if sm.updated[svc]:
          consume(sm[svc], svc)
          sm.all_checks()
      guarded(res, f"#{i} {svc} {desc} ({len(dat)} bytes)", one)
  finally:
    sm.close()
  return res


# ---- LogReader ----------------------------------------------------------------------------------------------------------

def fuzz_logreader(seed: int, n: int, tmp: Path) -> Result:
  import zstandard

  from selfdrive_glue.errors import UserError
  from selfdrive_glue.logs import LogReader
  from selfdrive_glue.messaging import member_of
  res = Result("LogReader")
  rng = random.Random(seed)
  events = list(event_corpus().values()) * 3
  plain = b"".join(events)
  seeds = {"none": plain, "zstd": zstandard.ZstdCompressor(level=3).compress(plain), "bz2": __import__("bz2").compress(plain)}
  path = tmp / "fuzz_rlog"
  for i in range(n):
    comp = rng.choice(list(seeds))
    if rng.random() < 0.5 and comp != "none":
      # mutate the events, then compress properly: the parser sees damage the decompressor cannot catch
      desc, body = mutate(rng, plain, events)
      data = zstandard.ZstdCompressor(level=1).compress(body) if comp == "zstd" else __import__("bz2").compress(body)
      desc = f"{comp}(mutated events: {desc})"
    else:
      desc, data = mutate(rng, seeds[comp], [plain])
      desc = f"{comp} file {desc}"
    suffix = {"none": "", "zstd": ".zst", "bz2": ".bz2"}[comp]
    p = path.with_suffix(suffix) if suffix else path
    p.write_bytes(data)

    def one(p=p):
      try:
        lr = LogReader(p)
      except UserError:
        res.clean_errors += 1
        return
      for ev in lr:
        member_of(ev)
      if lr.damage:
        res.clean_errors += 1
      for b in lr.raw_events():
        len(b)
    guarded(res, f"#{i} {desc} ({len(data)} bytes)", one)
    p.unlink(missing_ok=True)
  return res


# ---- VisionIPC client ---------------------------------------------------------------------------------------------------

class FakeServer:
  """A camera server's control socket answering each connection with whatever `reply` is set to (payload, fds)."""

  def __init__(self, name: str):
    from selfdrive_glue.visionipc import ipc_path
    self.path = ipc_path(name)
    self.reply: tuple[bytes, list[int]] = (b"", [])
    self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    self.sock.bind(self.path)
    self.sock.listen(8)
    self.sock.settimeout(0.2)
    self.stop = False
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self) -> None:
    while not self.stop:
      try:
        conn, _ = self.sock.accept()
      except OSError:
        continue
      with conn:
        try:
          conn.settimeout(1.0)
          conn.recv(64)
          payload, fds = self.reply
          if fds:
            conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
          elif payload:
            conn.send(payload)
        except OSError:
          pass

  def close(self) -> None:
    self.stop = True
    self.thread.join(2)
    self.sock.close()
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass


def fuzz_vipc(seed: int, n: int) -> Result:
  from selfdrive_glue import msgq
  from selfdrive_glue.nv12 import nv12_info
  from selfdrive_glue.services import DEFAULT_SEGMENT_SIZE
  from selfdrive_glue.visionipc import _DESC, _PACKET, VisionIpcClient, endpoint_name
  res = Result("VisionIpcClient")
  rng = random.Random(seed)
  name = f"fuzz{uuid.uuid4().hex[:6]}"
  w, h = 64, 48
  g = nv12_info(w, h)
  server_id = rng.getrandbits(64)
  nbuf = 3
  fds = []
  for _ in range(nbuf):
    fd = os.memfd_create("fuzzbuf", os.MFD_CLOEXEC)
    os.ftruncate(fd, g.size + 8)
    fds.append(fd)
  good_desc = [_DESC.pack(g.size, g.size + 8, 0, 0, fds[i], w, h, g.stride, g.uv_offset, 0, 0, server_id, i, 0, 0) for i in range(nbuf)]
  good_reply = b"".join(good_desc)
  srv = FakeServer(name)
  pub = msgq.PubSocket(endpoint_name(name, 0), DEFAULT_SEGMENT_SIZE)
  client = VisionIpcClient(name, 0, conflate=False)
  desc_fields = ["len", "mmap_len", "addr", "frame_id", "fd", "width", "height", "stride", "uv_offset", "y", "uv", "server_id", "idx",
                 "type", "handle"]
  try:
    for i in range(n):
      kind = rng.random()
      if kind < 0.45:
        # a buffer reply: field values, payload bytes or the fd count mutated
        fields = [list(_DESC.unpack(d)) for d in good_desc]
        nfds = nbuf
        r = rng.random()
        if r < 0.6:
          k = rng.randrange(len(desc_fields))
          fields[rng.randrange(nbuf)][k] = rng.choice((0, 1, -1 & 0xFFFFFFFF, 1 << 31, 1 << 40, 1 << 63, rng.getrandbits(16), g.size * 4))
          desc = f"descriptor {desc_fields[k]} mutated"
          if desc_fields[k] == "fd":
            fields[0][4] = fields[0][4] & 0x7FFFFFFF
          try:
            payload = b"".join(_DESC.pack(*f[:4], f[4] if f[4] < 2**31 else 0, *f[5:14], f[14] if f[14] < 2**31 else 0) for f in fields)
          except struct.error:
            payload = good_reply
        elif r < 0.8:
          desc, payload = mutate(rng, good_reply, [good_reply])
        else:
          nfds = rng.choice((0, 1, nbuf - 1))
          desc, payload = f"{nfds} fds for {nbuf} descriptors", good_reply
        srv.reply = (payload, fds[:nfds])

        def one():
          if not client.connect(False):
            res.clean_errors += 1
            return
          pub.send(_PACKET.pack(client.buffers[0].server_id, 0, 1, 0, 0, True))
          buf = client.recv(100)
          if buf is not None:
            int(buf.data.sum()) + int(buf.y.sum()) + int(buf.uv.sum()) + buf.frame_id
        guarded(res, f"#{i} connect: {desc} ({len(payload)} bytes)", one)
        srv.reply = (good_reply, fds)
      else:
        # a notification: random length, or a packet naming a random/foreign server or an impossible buffer index
        r = rng.random()
        if r < 0.3:
          pkt = rng.randbytes(rng.choice((1, 8, 47, 49, 96, 4096)))
          desc = f"{len(pkt)}-byte packet"
        else:
          sid = server_id if r < 0.7 else rng.getrandbits(64)
          idx = rng.choice((0, 1, nbuf - 1, nbuf, 2**32 - 1, 2**63, 2**64 - 1))
          pkt = _PACKET.pack(sid, idx, rng.getrandbits(32), rng.getrandbits(64), rng.getrandbits(64), rng.random() < 0.5)
          desc = f"packet server {'ours' if sid == server_id else 'foreign'} idx {idx}"
          if rng.random() < 0.3:
            _, pkt = mutate(rng, pkt, [pkt])
            desc += " mutated"

        def one(pkt=pkt):
          if not pkt:
            return
          pub.send(pkt)
          buf = client.recv(50)
          if buf is None:
            res.clean_errors += 1
          else:
            int(buf.y.sum()) + int(buf.uv.sum())
        guarded(res, f"#{i} recv: {desc}", one)
  finally:
    client.close()
    pub.close()
    srv.close()
    for fd in fds:
      os.close(fd)
  return res


# ---- CarParams (modeld reads it from Params at start) ---------------------------------------------------------------------

def fuzz_carparams(seed: int, n: int) -> Result:
  """Any exception is the clean refusal here (load_car_params logs it and uses defaults); only a process death or a hang is not."""
  from modeld_msm.modeld import _car_params_from
  from selfdrive_glue import messaging
  res = Result("CarParams")
  rng = random.Random(seed)
  cp = messaging.car.CarParams.new_message(carFingerprint="HONDA_CIVIC", steerRatio=15.3)
  good = cp.to_bytes()
  for i in range(n):
    desc, dat = mutate(rng, good, [good])

    def one(dat=dat):
      try:
        str(_car_params_from(dat).carFingerprint)
      except Exception:
        res.clean_errors += 1
    guarded(res, f"#{i} {desc} ({len(dat)} bytes)", one)
  return res


TARGETS = {"submaster": fuzz_submaster, "logreader": None, "vipc": fuzz_vipc, "carparams": fuzz_carparams}


def run_target(target: str, seed: int, n: int) -> Result:
  os.environ.setdefault("OPENPILOT_PREFIX", f"fuzz{uuid.uuid4().hex[:6]}")
  if target == "logreader":
    with tempfile.TemporaryDirectory() as d:
      return fuzz_logreader(seed, n, Path(d))
  return TARGETS[target](seed, n)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--inputs", type=int, default=2000, help="inputs per target")
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--target", choices=list(TARGETS), action="append", help="default: all")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  import logging
  logging.disable(logging.WARNING)   # every clean refusal logs a warning; thousands of them are noise here
  targets = args.target or list(TARGETS)
  if args.child:
    r = run_target(targets[0], args.seed, args.inputs)
    print(f"RESULT {r.tried} {r.crashes} {r.clean_errors}")
    for e in r.examples:
      print("EXAMPLE", e.replace("\n", "\n  "))
    return 0
  import subprocess
  rows = []
  for t in targets:
    # each target in a child process, so a signal death (SIGBUS from a short mapping, SIGSEGV) is counted, not fatal
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, __file__, "--child", "--target", t, "--inputs", str(args.inputs), "--seed", str(args.seed)],
                       capture_output=True, text=True)
    dt = time.monotonic() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")), None)
    if p.returncode != 0 or line is None:
      rows.append((t, "?", f"died ({p.returncode})", "?", dt))
      print(p.stdout[-2000:], p.stderr[-2000:])
      continue
    tried, crashes, clean = map(int, line.split()[1:])
    rows.append((t, tried, crashes, clean, dt))
    for ln in p.stdout.splitlines():
      if ln.startswith("EXAMPLE") or ln.startswith("  "):
        print(ln)
  print(f"\nfuzz, seed {args.seed}, {args.inputs} inputs per target")
  print(f"{'target':<12} {'tried':>7} {'crashes':>8} {'refused cleanly':>16} {'seconds':>8}")
  for t, tried, crashes, clean, dt in rows:
    print(f"{t:<12} {tried!s:>7} {crashes!s:>8} {clean!s:>16} {dt:>8.1f}")
  return 0 if all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
