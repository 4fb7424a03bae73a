#!/usr/bin/env python3
"""IPC benchmark: our pure-Python msgq and VisionIPC, publisher and reader in separate processes.

Peer measured in the same run: a multiprocessing Pipe (AF_UNIX socketpair, pickled bytes) carrying the same payloads.
If the C++ msgq bindings are importable (MSGQ_PATH=/path/to/built/msgq checkout), the C++ reader is measured too.
Latency = reader's clock after the payload is in hand - writer's clock before send (CLOCK_MONOTONIC is system-wide).

  .venv/bin/python bench/bench_ipc.py [--quick]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import struct
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfdrive_glue import messaging, msgq  # noqa: E402
from selfdrive_glue.visionipc import VisionIpcClient, VisionIpcServer, VisionStreamType  # noqa: E402

CTX = multiprocessing.get_context("fork")
STAMP = struct.Struct("<qI")   # send time (ns), sequence number


def model_v2_bytes() -> bytes:
  """A modelV2 Event shaped like stock modeld's (33-point plans with stds, 4 lanes, 2 edges, 3 leads, meta)."""
  e = messaging.new_message("modelV2", valid=True)
  m = e.modelV2
  r = np.random.default_rng(0)

  def xyzt(b, n=33, stds=True):
    b.x, b.y, b.z, b.t = (r.random(n).tolist() for _ in range(4))
    if stds:
      b.xStd, b.yStd, b.zStd = (r.random(n).tolist() for _ in range(3))
  for name in ("position", "orientation", "velocity", "orientationRate", "acceleration"):
    xyzt(getattr(m, name), stds=name == "position")
  for lst, n in ((m.init("laneLines", 4), 4), (m.init("roadEdges", 2), 2)):
    for i in range(n):
      xyzt(lst[i], stds=False)
  m.laneLineProbs, m.laneLineStds, m.roadEdgeStds = [0.5] * 4, [0.1] * 4, [0.1] * 2
  leads = m.init("leadsV3", 3)
  for ld in leads:
    for f in ("t", "x", "xStd", "y", "yStd", "v", "vStd", "a", "aStd"):
      setattr(ld, f, r.random(6).tolist())
  m.meta.desireState, m.meta.desirePrediction = r.random(8).tolist(), r.random(32).tolist()
  dp = m.meta.disengagePredictions
  for f in ("t", "brakeDisengageProbs", "gasDisengageProbs", "steerOverrideProbs", "brake3MetersPerSecondSquaredProbs",
            "brake4MetersPerSecondSquaredProbs", "brake5MetersPerSecondSquaredProbs", "gasPressProbs", "brakePressProbs"):
    setattr(dp, f, r.random(6).tolist())
  return e.to_bytes()


def _stamp(payload: bytearray, seq: int) -> None:
  STAMP.pack_into(payload, len(payload) - STAMP.size, time.perf_counter_ns(), seq)


def _unstamp(payload) -> tuple[int, int]:
  return STAMP.unpack_from(payload, len(payload) - STAMP.size)


# ---- readers (child processes) ----
def _drain(sock, n, out) -> None:
  """Receive up to n stamped messages (stop on a 2 s timeout) and report (latencies, count, first, last)."""
  lat, first, last, got = [], None, None, 0
  while got < n:
    d = sock.receive()
    if d is None:
      break
    now = time.perf_counter_ns()
    lat.append(now - _unstamp(d)[0])
    first = first or now
    last, got = now, got + 1
  out.put((lat, got, first, last))


def _msgq_reader(name, size, n, out, ready):
  sock = msgq.SubSocket(name, size, timeout=2000)
  ready.set()
  _drain(sock, n, out)


def _cpp_reader(name, size, n, out, ready):
  from msgq import sub_sock  # type: ignore[import-not-found]
  sock = sub_sock(name, segment_size=size, timeout=2000)
  ready.set()
  _drain(sock, n, out)


def _pipe_reader(conn, n, out, ready):
  ready.set()
  lat, first, last = [], None, None
  for _ in range(n):
    d = conn.recv_bytes()
    now = time.perf_counter_ns()
    lat.append(now - _unstamp(d)[0])
    first = first or now
    last = now
  out.put((lat, n, first, last))


def run_transport(kind: str, payload: bytes, n: int, rate_hz: float | None) -> dict:
  """rate_hz None: back-to-back (throughput); else paced (latency)."""
  name, size = "modelV2", 10 * 1024 * 1024
  out, ready = CTX.Queue(), CTX.Event()
  buf = bytearray(payload)
  if kind == "pipe":
    rx, tx = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_pipe_reader, args=(rx, n, out, ready))
    proc.start()
    ready.wait(10)
    send = tx.send_bytes
  else:
    pub = msgq.PubSocket(name, size)
    proc = CTX.Process(target=_msgq_reader if kind == "msgq" else _cpp_reader, args=(name, size, n, out, ready))
    proc.start()
    ready.wait(10)
    while pub.q.num_readers() < 1:
      time.sleep(0.001)
    send = pub.send
  time.sleep(0.1)
  t0 = time.perf_counter()
  for i in range(n):
    if rate_hz:
      time.sleep(max(0., t0 + i / rate_hz - time.perf_counter()))
    _stamp(buf, i)
    send(buf)
  sent_s = time.perf_counter() - t0
  lat, got, first, last = out.get(timeout=60)
  proc.join(10)
  if kind != "pipe":
    pub.close()
  lat_ms = np.array(lat) / 1e6 if lat else np.array([np.nan])
  span = (last - first) / 1e9 if got > 1 else float("nan")
  return {"p50": float(np.median(lat_ms)), "p99": float(np.percentile(lat_ms, 99)), "got": got, "n": n,
          "mps": got / max(span, sent_s) if got > 1 else 0., "MBps": got * len(payload) / max(span, sent_s) / 1e6 if got > 1 else 0.}


# ---- VisionIPC ----
def _vipc_camera(n, in_place, go, done):
  srv = VisionIpcServer("benchcam")
  srv.create_buffers(VisionStreamType.ROAD, 8, 1928, 1208)
  srv.start_listener()
  frame = np.random.default_rng(1).integers(0, 255, srv.buffers[VisionStreamType.ROAD][0].len, dtype=np.uint8)
  go.wait(10)
  time.sleep(0.1)
  for i in range(n):
    t = time.perf_counter_ns()
    if in_place:
      buf = srv.get_buffer(VisionStreamType.ROAD)   # a camera/renderer fills it in place; hand-off is the notification
      srv.send_buf(buf, i, t, t)
    else:
      srv.send(VisionStreamType.ROAD, frame, i, t, t)   # copies 4.8 MB into the shared buffer first
    time.sleep(0.05)
  done.wait(10)
  srv.close()


def run_vipc(n: int, in_place: bool) -> dict:
  go, done = CTX.Event(), CTX.Event()
  p = CTX.Process(target=_vipc_camera, args=(n, in_place, go, done))
  p.start()
  client = VisionIpcClient("benchcam", VisionStreamType.ROAD, True)
  assert client.connect(True)
  go.set()
  lat = []
  deadline = time.monotonic() + 30
  while len(lat) < n and time.monotonic() < deadline:
    buf = client.recv(500)
    if buf is not None:
      _ = int(buf.data[0])   # touch the frame: it is a view, nothing was copied
      lat.append((time.perf_counter_ns() - client.timestamp_sof) / 1e6)
  done.set()
  p.join(10)
  client.close()
  a = np.array(lat)
  return {"p50": float(np.median(a)), "p99": float(np.percentile(a, 99)), "got": len(lat), "n": n}


def _pipe_frame_reader(conn, n, out):
  lat = []
  for _ in range(n):
    d = conn.recv_bytes()
    lat.append((time.perf_counter_ns() - _unstamp(d)[0]) / 1e6)
  out.put(lat)


def run_pipe_frames(n: int) -> dict:
  rx, tx = CTX.Pipe(duplex=False)
  out = CTX.Queue()
  p = CTX.Process(target=_pipe_frame_reader, args=(rx, n, out))
  p.start()
  frame = bytearray(4804608 + STAMP.size)
  for i in range(n):
    _stamp(frame, i)
    tx.send_bytes(frame)
    time.sleep(0.05)
  a = np.array(out.get(timeout=60))
  p.join(10)
  return {"p50": float(np.median(a)), "p99": float(np.percentile(a, 99)), "got": n, "n": n}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="fewer messages (smoke run)")
  args = ap.parse_args()
  os.environ["OPENPILOT_PREFIX"] = f"bench{uuid.uuid4().hex[:8]}"
  peers = ["msgq", "pipe"]
  if os.environ.get("MSGQ_PATH"):
    sys.path.insert(0, os.environ["MSGQ_PATH"])
    try:
      import msgq as _cpp  # type: ignore[import-not-found]  # noqa: F401
      peers.append("cpp-msgq")
    except ImportError as e:
      print(f"(C++ msgq not importable from MSGQ_PATH: {e})")
  scale = 0.2 if args.quick else 1.0
  mv2 = model_v2_bytes()
  big = bytes(2 * 1024 * 1024)
  cases = [(f"modelV2 {len(mv2) / 1024:.1f} KiB @ 100 Hz", mv2, int(600 * scale), 100.),
           (f"modelV2 {len(mv2) / 1024:.1f} KiB back-to-back", mv2, int(3000 * scale), None),
           ("2 MiB @ 20 Hz", big, int(100 * scale), 20.),
           ("2 MiB back-to-back", big, int(200 * scale), None)]
  try:
    print("vs pipe: paced rows compare p50 latency (pipe p50 / this p50), back-to-back rows compare MB/s delivered; >1 is better.")
    print("Back-to-back msgq latency includes queueing: the writer never waits for readers (pipes block it), and a lapped reader")
    print("drops its backlog, hence recv < sent for 2 MiB.\n")
    print(f"{'case':36} {'transport':>9} {'p50 ms':>8} {'p99 ms':>8} {'recv/sent':>10} {'msg/s':>9} {'MB/s':>8} {'vs pipe':>8}")
    for label, payload, n, rate in cases:
      res = {k: run_transport(k if k != "cpp-msgq" else "cpp", payload, n, rate) for k in peers}
      for k, r in res.items():
        if rate:
          ratio = res["pipe"]["p50"] / r["p50"] if r["p50"] > 0 else float("nan")
        else:
          ratio = r["MBps"] / res["pipe"]["MBps"] if res["pipe"]["MBps"] > 0 else float("nan")
        print(f"{label:36} {k:>9} {r['p50']:8.3f} {r['p99']:8.3f} {r['got']:>5}/{r['n']:<4} {r['mps']:9.0f} {r['MBps']:8.1f} {ratio:7.2f}x")
    nf = int(60 * scale) or 10
    rows = [("1928x1208 NV12, in-place + notify", run_vipc(nf, True)), ("1928x1208 NV12, send() copies 4.8 MB", run_vipc(nf, False)),
            ("1928x1208 via pipe (peer)", run_pipe_frames(nf))]
    print(f"\n{'VisionIPC frame hand-off':38} {'p50 ms':>8} {'p99 ms':>8} {'frames':>8} {'p50 vs pipe':>11}")
    for label, r in rows:
      print(f"{label:38} {r['p50']:8.3f} {r['p99']:8.3f} {r['got']:>4}/{r['n']:<3} {rows[2][1]['p50'] / r['p50']:10.2f}x")
  finally:
    shutil.rmtree(f"/dev/shm/msgq_{os.environ['OPENPILOT_PREFIX']}", ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
