"""cereal.messaging for modeld-msm: Events over msgq with openpilot 0.11's PubMaster / SubMaster semantics.

Differences from openpilot, on purpose:
- SubMaster never raises on a bad message (truncated, garbage, or an Event of another service): it logs once per
  service, counts it in `bad_messages`, and keeps the previous data.
- logMonoTime comes from time.monotonic_ns() (openpilot's Python uses time.monotonic() too).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable

import capnp

from selfdrive_glue.capnp_check import check_pointers
from selfdrive_glue.msgq import IpcError, MultiplePublishersError, Poller, PubSocket, SubSocket
from selfdrive_glue.schema import SOURCE, car, log
from selfdrive_glue.services import RENAMED, SERVICE_LIST, SERVICES, segment_size

__all__ = ["log", "car", "SOURCE", "SERVICES", "SERVICE_LIST", "new_message", "log_from_bytes", "pub_sock", "sub_sock", "PubMaster",
           "SubMaster", "IpcError", "MultiplePublishersError", "BadMessage", "drain_sock_raw", "drain_sock", "recv_sock", "recv_one",
           "recv_one_or_none", "recv_one_retry", "FrequencyTracker", "Poller", "service_of", "member_of"]

_log = logging.getLogger(__name__)
NO_TRAVERSAL_LIMIT = 2**64 - 1


# Event members sent on a service of another name. driverMonitoringState moved to Event @151 in openpilot after PR #37799:
# our schema (0.11's names) calls that member driverMonitoringStateV2, and openpilot's newer schema calls the old @71
# driverMonitoringStateDEPRECATED. Either carries isRHD, the one field modeld reads, so both count as the service.
SERVICE_OF_MEMBER = {"driverMonitoringStateV2": "driverMonitoringState", "driverMonitoringStateDEPRECATED": "driverMonitoringState"}
# services whose Events carry a member of another name: master's renamed services (selfdrive_glue/services.py RENAMED, e.g.
# liveCalibration -> extrinsicsCalibration). cereal renames a union member in place, keeping its ordinal and type, so such
# an Event reads as the 0.11 member in our schema. (The reference schemas here predate the renames; an Event of a new
# ordinal would be refused as not the one expected, counted, and dropped.)
MEMBER_OF_SERVICE = dict(RENAMED)


def service_of(evt) -> str:
  """The service an Event belongs to: its union member's name, or the service that member stands for."""
  which = evt.which()
  return SERVICE_OF_MEMBER.get(which, which)


def member_of(evt):
  """The union member's reader, whatever the member is called in the schema in use."""
  return getattr(evt, evt.which())


class BadMessage(ValueError):
  """Bytes that are not a readable Event (or not the one expected)."""


def new_message(service: str | None = None, size: int | None = None, **kwargs) -> capnp.lib.capnp._DynamicStructBuilder:
  """An Event builder with valid=False and logMonoTime=now, with `service` initialised (size: list length). A master name
  (narrowRoadCameraState, ...) initialises the member it renamed: the bytes master's openpilot sends on that queue."""
  args = {"valid": False, "logMonoTime": time.monotonic_ns(), **kwargs}
  dat = log.Event.new_message(**args)
  service = MEMBER_OF_SERVICE.get(service, service) if service is not None else None
  if service is not None:
    if size is None:
      dat.init(service)
    else:
      dat.init(service, size)
  return dat


def log_from_bytes(dat: bytes | bytearray | memoryview, struct=None) -> capnp.lib.capnp._DynamicStructReader:
  """Reader over one unpacked, segment-table-framed message (an Event by default). Raises BadMessage on bad framing."""
  struct = log.Event if struct is None else struct
  dat = bytes(dat)  # pycapnp pins a bytes object for the reader's lifetime; other buffers would be released on exit
  if len(dat) < 8 or len(dat) % 8:
    raise BadMessage(f"{len(dat)} bytes is not a capnp message (need a non-empty multiple of 8)")
  try:
    with struct.from_bytes(dat, traversal_limit_in_words=NO_TRAVERSAL_LIMIT) as msg:
      return msg
  except (capnp.KjException, ValueError) as e:
    raise BadMessage(f"unreadable capnp message ({len(dat)} bytes): {str(e).splitlines()[0][:160]}") from e


def checked_event(dat: bytes, service: str | None = None) -> capnp.lib.capnp._DynamicStructReader:
  """log_from_bytes plus a full bounds-checked traversal, so later field reads cannot fail; optionally the member."""
  msg = log_from_bytes(dat)
  try:
    # every pointer in bounds, so later field reads can only raise KjException (pycapnp's own total_size aborts the process)
    check_pointers(bytes(dat))
    which = service_of(msg)
    member_of(msg)   # the member pointer may be of the wrong kind (a list where the struct should be)
  except (capnp.KjException, ValueError) as e:
    raise BadMessage(f"corrupt Event ({len(dat)} bytes): {str(e).splitlines()[0][:160]}") from e
  if service is not None and which != MEMBER_OF_SERVICE.get(service, service):
    raise BadMessage(f"expected a '{service}' Event, got '{which}'")
  return msg


def pub_sock(endpoint: str) -> PubSocket:
  return PubSocket(endpoint, segment_size(endpoint))


def sub_sock(endpoint: str, poller: Poller | None = None, addr: str = "127.0.0.1", conflate: bool = False,
             timeout: int | None = None) -> SubSocket:
  if addr != "127.0.0.1":
    raise IpcError(f"msgq is shared memory on this machine only; cannot subscribe to {endpoint} at {addr}")
  sock = SubSocket(endpoint, segment_size(endpoint), conflate=conflate, timeout=timeout)
  if poller is not None:
    poller.registerSocket(sock)
  return sock


def drain_sock_raw(sock: SubSocket, wait_for_one: bool = False) -> list[bytes]:
  ret: list[bytes] = []
  while True:
    dat = sock.receive(non_blocking=not (wait_for_one and not ret))
    if dat is None:
      return ret
    ret.append(dat)


def drain_sock(sock: SubSocket, wait_for_one: bool = False) -> list:
  return [log_from_bytes(d) for d in drain_sock_raw(sock, wait_for_one)]


def recv_sock(sock: SubSocket, wait: bool = False):
  """Latest message on the socket, or None."""
  raw = drain_sock_raw(sock, wait_for_one=wait)
  return log_from_bytes(raw[-1]) if raw else None


def recv_one(sock: SubSocket):
  dat = sock.receive()
  return None if dat is None else log_from_bytes(dat)


def recv_one_or_none(sock: SubSocket):
  dat = sock.receive(non_blocking=True)
  return None if dat is None else log_from_bytes(dat)


def recv_one_retry(sock: SubSocket):
  while True:
    dat = sock.receive()
    if dat is not None:
      return log_from_bytes(dat)


class FrequencyTracker:
  """Is a service arriving at the rate SubMaster can observe? Bounds follow openpilot 0.11 (see docs/openpilot-ipc §2)."""

  def __init__(self, service_freq: float, update_freq: float, is_polled: bool):
    freq = max(min(service_freq, update_freq), 1.)
    if is_polled:
      lo = hi = freq
    else:
      hi = min(freq, update_freq)
      if service_freq >= 2 * update_freq:
        lo = update_freq
      elif update_freq >= 2 * service_freq:
        lo = freq
      else:
        lo = freq / 2.
    self.min_freq, self.max_freq = lo * 0.8, hi * 1.2
    self.short_window = max(int(freq), 1)
    self.dts: deque[float] = deque(maxlen=int(10 * freq))
    self.prev_time = 0.

  def record(self, t: float) -> None:
    if self.prev_time > 1e-5:
      self.dts.append(t - self.prev_time)
    self.prev_time = t

  @property
  def valid(self) -> bool:
    if not self.dts:
      return False
    recent = list(self.dts)[-self.short_window:]
    for window in (self.dts, recent):
      total = sum(window)
      if total > 0 and self.min_freq <= len(window) / total <= self.max_freq:
        return True
    return False


class SubMaster:
  def __init__(self, services: Iterable[str], poll: str | None = None, ignore_alive: Iterable[str] | None = None,
               ignore_avg_freq: Iterable[str] | None = None, ignore_valid: Iterable[str] | None = None, addr: str = "127.0.0.1",
               frequency: float | None = None):
    self.services = list(services)
    unknown = [s for s in self.services if s not in SERVICE_LIST]
    if unknown:
      raise IpcError(f"unknown service(s) {unknown}: not in openpilot's service table")
    self.frame = -1
    self.poll = poll
    polled = [poll] if poll is not None else self.services
    self.non_polled_services = [s for s in self.services if s not in polled]
    self.ignore_alive = set(ignore_alive or ())
    self.ignore_average_freq = set(ignore_avg_freq or ())
    self.ignore_valid = set(ignore_valid or ())
    self.simulation = bool(int(os.getenv("SIMULATION", "0") or "0"))
    self.update_freq = frequency or max([SERVICE_LIST[s].frequency for s in polled] or [1.])
    self.bad_messages = 0
    self.bad_by_service = dict.fromkeys(self.services, 0)

    self.poller = Poller()
    self.sock: dict[str, SubSocket] = {}
    self.data: dict = {}
    self.freq_tracker: dict[str, FrequencyTracker] = {}
    self.updated = dict.fromkeys(self.services, False)
    self.seen = dict.fromkeys(self.services, False)
    self.recv_time = dict.fromkeys(self.services, 0.)
    self.recv_frame = dict.fromkeys(self.services, 0)
    self.logMonoTime = dict.fromkeys(self.services, 0)
    self.alive, self.freq_ok, self.valid = {}, {}, {}
    for s in self.services:
      self.sock[s] = sub_sock(s, poller=self.poller if s in polled else None, addr=addr, conflate=True)
      hz = SERVICE_LIST[s].frequency
      self.freq_tracker[s] = FrequencyTracker(hz, self.update_freq, s == poll)
      self.data[s] = _default_member(s)
      on_demand = hz <= 1e-5
      self.alive[s] = self.freq_ok[s] = self.valid[s] = on_demand

  def __getitem__(self, s: str):
    return self.data[s]

  def __contains__(self, s: str) -> bool:
    return s in self.data

  def update(self, timeout: int = 100) -> None:
    msgs = []
    for sock in self.poller.poll(timeout):
      msgs.append((sock.name, sock.receive(non_blocking=True)))
    for s in self.non_polled_services:
      msgs.append((s, self.sock[s].receive(non_blocking=True)))
    self.update_msgs(time.monotonic(), msgs)

  def _parse(self, s: str, dat: bytes):
    try:
      return checked_event(dat, s)
    except BadMessage as e:
      self.bad_messages += 1
      self.bad_by_service[s] += 1
      if self.bad_by_service[s] == 1 or self.bad_by_service[s] % 100 == 0:
        _log.warning("SubMaster: dropped bad message on '%s' (%d so far): %s", s, self.bad_by_service[s], e)
      return None

  def update_msgs(self, cur_time: float, msgs) -> None:
    """msgs: (service, bytes|None) pairs, or Event readers (as openpilot's replay tools pass)."""
    self.frame += 1
    self.updated = dict.fromkeys(self.services, False)
    for item in msgs:
      if isinstance(item, tuple):
        s, dat = item
        msg = None if dat is None else self._parse(s, dat)
      else:
        msg, s = item, (service_of(item) if item is not None else None)
      if msg is None or s not in self.data:
        continue
      self.seen[s] = self.updated[s] = True
      self.freq_tracker[s].record(cur_time)
      self.recv_time[s] = cur_time
      self.recv_frame[s] = self.frame
      self.data[s] = member_of(msg)
      self.logMonoTime[s] = msg.logMonoTime
      self.valid[s] = msg.valid

    for s in self.services:
      hz = SERVICE_LIST[s].frequency
      if hz > 1e-5 and not self.simulation:
        self.alive[s] = (cur_time - self.recv_time[s]) < (10. / hz) and self.seen[s]
      else:
        self.alive[s] = self.seen[s] or hz <= 1e-5
      if hz <= 0.99 or s in self.ignore_average_freq:
        self.freq_ok[s] = True
      elif self.simulation:
        self.freq_ok[s] = self.seen[s]
      else:
        self.freq_ok[s] = self.freq_tracker[s].valid

  def all_alive(self, service_list: Iterable[str] | None = None) -> bool:
    return all(self.alive[s] for s in (service_list or self.services) if s not in self.ignore_alive)

  def all_freq_ok(self, service_list: Iterable[str] | None = None) -> bool:
    return all(self.freq_ok[s] for s in (service_list or self.services) if s not in self.ignore_average_freq)

  def all_valid(self, service_list: Iterable[str] | None = None) -> bool:
    return all(self.valid[s] for s in (service_list or self.services) if s not in self.ignore_valid)

  def all_checks(self, service_list: Iterable[str] | None = None) -> bool:
    return self.all_alive(service_list) and self.all_freq_ok(service_list) and self.all_valid(service_list)

  def close(self) -> None:
    for sock in self.sock.values():
      sock.close()


def _default_member(s: str):
  """The reader a never-received service shows: the member's defaults (None if our schema does not type it)."""
  try:
    try:
      dat = new_message(s)
    except capnp.KjException:
      dat = new_message(s, 0)  # list members need a size
    return getattr(dat.as_reader(), MEMBER_OF_SERVICE.get(s, s))
  except Exception:
    return None


class PubMaster:
  def __init__(self, services: Iterable[str]):
    self.sock = {s: pub_sock(s) for s in services}

  def send(self, s: str, dat) -> None:
    if not isinstance(dat, bytes | bytearray | memoryview):
      dat = dat.to_bytes()
    self.sock[s].send(dat)

  def all_readers_updated(self, s: str) -> bool:
    return self.sock[s].all_readers_updated()

  def wait_for_readers_to_update(self, s: str, timeout: float, dt: float = 0.05) -> bool:
    for _ in range(int(timeout / dt) + 1):
      if self.all_readers_updated(s):
        return True
      time.sleep(dt)
    return False

  def close(self) -> None:
    for sock in self.sock.values():
      sock.close()
