"""replay --engine ray on a real Ray cluster on loopback: 8 short synthetic segments, a worker killed mid-run, outputs
byte-identical to --jobs 1, a rerun that skips finished segments, and the CLI joining a `ray start --head` cluster."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from modeld_msm import replay_store as store
from modeld_msm.replay import replay_many
from selfdrive_glue.route import expand_segments
from selfdrive_glue.synth import synth_route

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("replay")  # the artifact fixture of test_replay.py is built once per worker group

import test_replay  # noqa: E402

artifact = test_replay.artifact  # the tiny 1344x760 CPU artifact fixture, cached under .cache/ and shared with test_replay.py

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}  # no usage report from a test cluster (and nothing outside can be reached)


@pytest.fixture(scope="module")
def route(tmp_path_factory):
  d = tmp_path_factory.mktemp("ray") / "route"
  synth_route(d, 8, 0.5, 17, "1344x760", qcamera=False, progress=False)
  return d


@pytest.fixture(scope="module")
def serial(route, artifact, tmp_path_factory):
  """The reference: the same segments through the local engine, one process."""
  out = tmp_path_factory.mktemp("serial")
  res = replay_many(expand_segments([str(route)]), artifact, out, jobs=1, progress=False)
  assert not any(r.error for r in res) and sum(r.frames for r in res) > 50
  return out


@pytest.fixture
def local_ray(monkeypatch):
  for k, v in RAY_ENV.items():
    monkeypatch.setenv(k, v)
  tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short; pytest's tmp_path is too long
  ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
  yield
  ray.shutdown()
  shutil.rmtree(tmp, ignore_errors=True)


def _outputs(d: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(d.glob("*.zst"))}


def test_worker_killed_mid_run_output_identical_to_serial(route, serial, artifact, local_ray, tmp_path):
  from modeld_msm.replay_ray import replay_ray
  killed: list[int] = []

  def kill_once(actor: int, pid: int, results):
    if not killed:  # this actor has its next task running (2 in flight per actor): kill the process under it
      os.kill(pid, signal.SIGKILL)
      killed.append(pid)

  run = replay_ray(expand_segments([str(route)]), artifact, tmp_path / "out", jobs=2, progress=False, on_result=kill_once)
  assert killed and run.workers == 2
  assert [r.error for r in run.results] == [None] * 8
  assert run.restarts >= 1 and run.done_before == 0
  assert _outputs(tmp_path / "out") == _outputs(serial) and len(_outputs(serial)) == 8
  # the killed worker's half-written log was cleaned up, and nothing else is there
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*_outputs(serial), *(f"{n}.json" for n in _outputs(serial))])


def test_rerun_skips_finished_segments_and_redoes_the_rest(route, serial, artifact, local_ray, tmp_path):
  from modeld_msm.replay_ray import replay_ray
  segs = expand_segments([str(route)])
  out = tmp_path / "out"
  first = replay_ray(segs[:5], artifact, out, jobs=2, progress=False)
  assert first.done_before == 0 and not any(r.error for r in first.results)
  # a finished output changed behind our back, and one whose worker died before its sidecar: both are replayed again
  victim, lost = out / f"{segs[1].name}.zst", out / f"{segs[2].name}.zst"
  victim.write_bytes(victim.read_bytes()[:-3])
  store.meta_path(lost).unlink()
  second = replay_ray(segs, artifact, out, jobs=2, progress=False)
  assert second.done_before == 3  # segments 0, 3 and 4
  assert [r.error for r in second.results] == [None] * 8 and all(r.frames > 0 for r in second.results)
  assert _outputs(out) == _outputs(serial)
  # another mode is another key: nothing counts as done
  third = replay_ray(segs[:2], artifact, tmp_path / "out", jobs=2, progress=False, mode="warmup", warmup_steps=4)
  assert third.done_before == 0 and "warm-up on the last 4 frames" in third.results[1].start


def test_keys_follow_content_not_names(route, artifact, tmp_path):
  segs = expand_segments([str(route)])
  copy = tmp_path / segs[0].name
  shutil.copytree(segs[0].path, copy)
  (copy / "qlog.zst").unlink()  # not read by replay
  key = store.output_key([segs[0]], artifact, "segment", 100)
  assert store.output_key(expand_segments([str(copy)]), artifact, "segment", 100) == key
  assert store.output_key([segs[0]], artifact, "route", 100) != key
  assert store.output_key([segs[0]], artifact, "warmup", 100) != store.output_key([segs[0]], artifact, "warmup", 50)
  assert store.output_key([segs[1], segs[0]], artifact, "warmup", 100) != store.output_key([segs[0]], artifact, "warmup", 100)
  fcam = copy / "fcamera.hevc"
  fcam.write_bytes(fcam.read_bytes()[:-1] + b"\0")
  assert store.output_key(expand_segments([str(copy)]), artifact, "segment", 100) != key


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # ~40 s: a head node coming up, two CLI runs joining it
def test_cli_joins_a_cluster_by_address_and_resumes(route, serial, artifact, tmp_path):
  """`ray start --head` on 127.0.0.1 as a subprocess (stopped by its pid), the CLI joining it with --address."""
  tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
  port = _free_port()
  env = {**os.environ, **RAY_ENV}
  ray_bin = Path(sys.executable).parent / "ray"
  head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                           "--include-dashboard=false", f"--temp-dir={tmp}", "--disable-usage-stats"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    addr = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "modeld_msm.cli", "replay", str(route), "-o", str(tmp_path / "out"), "--artifact", str(artifact),
           "--engine", "ray", "--address", addr, "--quiet"]
    deadline = time.monotonic() + 60
    while True:  # the head takes a few seconds to come up
      r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
      if r.returncode == 0 or time.monotonic() > deadline or "cannot reach the Ray cluster" not in r.stderr:
        break
      time.sleep(2)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 8 and all("frames by encode index" in ln and "start: fresh" in ln for ln in lines)
    assert _outputs(tmp_path / "out") == _outputs(serial)
    meta = json.loads(store.meta_path(tmp_path / "out" / f"{expand_segments([str(route)])[0].name}.zst").read_text())
    assert Path(meta["segment"]) == (route / meta["result"]["segment"]).resolve()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert again.stdout == r.stdout  # the same summary lines, from the recorded results
    assert "8 of 8 segments were already done" in again.stderr
  finally:
    os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the cluster it started when it is terminated
    try:
      head.wait(30)
    except subprocess.TimeoutExpired:
      os.killpg(head.pid, signal.SIGKILL)
      head.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def test_cli_refusals(route, tmp_path):
  r = subprocess.run([sys.executable, "-m", "modeld_msm.cli", "replay", str(route), "-o", str(tmp_path / "o"), "--address", "127.0.0.1:1"],
                     capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert r.returncode == 2 and "add --engine ray" in r.stderr
