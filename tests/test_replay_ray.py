"""replay --engine ray on a real Ray cluster on loopback: 8 short synthetic segments, a worker killed mid-run, outputs
byte-identical to --jobs 1, a rerun that skips finished segments, the CLI joining a `ray start --head` cluster, and GPU
packing (--gpus-per-actor) on a cluster that declares a GPU it does not have."""
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

from offcar import replay_store as store
from offcar.replay import replay_many
from selfdrive_glue.errors import UserError
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


@pytest.fixture
def fake_gpu_ray(monkeypatch):
  """A loopback cluster declaring one GPU that this machine does not have: Ray schedules and sets CUDA_VISIBLE_DEVICES
  by its resource count alone, so packing is tested without a GPU (nothing here touches one)."""
  for k, v in RAY_ENV.items():
    monkeypatch.setenv(k, v)
  tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
  ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
  yield
  ray.shutdown()
  shutil.rmtree(tmp, ignore_errors=True)


def _outputs(d: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(d.glob("*.zst"))}


def test_worker_killed_mid_run_output_identical_to_serial(route, serial, artifact, local_ray, tmp_path):
  from offcar.replay_ray import replay_ray
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
  from offcar.replay_ray import replay_ray
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
  """`ray start --head` on 127.0.0.1 as a subprocess (stopped by its pid), the CLI joining it with --address. The cluster is
  the test's own: its temp dir, port, a fresh auth token and a HOME of its own, so a token another cluster left in
  ~/.ray (or RAY_AUTH_* in the environment) cannot make the join fail with InvalidAuthToken."""
  import secrets
  tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
  env.update(RAY_ENV, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), HOME=tmp)
  ray_bin = Path(sys.executable).parent / "ray"
  head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                           "--include-dashboard=false", f"--temp-dir={tmp}", "--disable-usage-stats"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    addr = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cli.main", "replay", str(route), "-o", str(tmp_path / "out"), "--artifact", str(artifact),
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


def test_cli_refusals(route, artifact, tmp_path):
  base = [sys.executable, "-m", "cli.main", "replay", str(route), "-o", str(tmp_path / "o"), "--artifact", str(artifact)]
  r = subprocess.run([*base, "--address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert r.returncode == 2 and "add --engine ray" in r.stderr
  r = subprocess.run([*base, "--gpus-per-actor", "0.5"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert r.returncode == 2 and "add --engine ray" in r.stderr
  # a CPU artifact asks for no GPU: refused before any cluster starts (nothing to join at this address either)
  r = subprocess.run([*base, "--engine", "ray", "--gpus-per-actor", "0.5", "--address", "127.0.0.1:1"], capture_output=True, text=True,
                     timeout=120, cwd=ROOT, env={**os.environ, **RAY_ENV})
  assert r.returncode == 2 and "is for CPU, not a GPU" in r.stderr and not (tmp_path / "o").exists()


# ---- GPU packing: --gpus-per-actor -> Ray num_gpus ----

def test_actor_options_ask_the_gpu_share_only_for_gpu_artifacts():
  from offcar.replay_ray import ACTORS_PER_GPU, TASK_RETRIES, actor_options
  base = {"num_cpus": 1, "max_restarts": -1, "max_task_retries": TASK_RETRIES}
  assert actor_options("CPU") == base  # no GPU asked: Ray leaves CUDA_VISIBLE_DEVICES alone and packs by CPUs
  assert actor_options("CPU", 0) == base
  assert actor_options("CUDA") == {**base, "num_gpus": 1 / ACTORS_PER_GPU} and ACTORS_PER_GPU == 4
  assert actor_options("NV", 0.5)["num_gpus"] == 0.5 and actor_options("AMD", 1)["num_gpus"] == 1.0
  for device, frac, words in (("CPU", 0.25, "not a GPU that Ray places"), ("QCOM", 0.5, "not a GPU that Ray places"), ("CUDA", 0, "need a GPU"),
                              ("CUDA", 1.5, "between 0 and 1"), ("NV", -0.25, "between 0 and 1"), ("AMD", float("nan"), "between 0 and 1")):
    with pytest.raises(UserError, match=words):
      actor_options(device, frac)


def test_actor_capacity_is_bounded_by_cpus_and_by_whole_gpus():
  from offcar.replay_ray import actor_capacity
  assert actor_capacity(16, 1, 0.25) == 4  # the H200 host: 4 replayers share its GPU
  assert actor_capacity(2, 1, 0.25) == 2  # CPUs bound it: every actor also takes one
  assert actor_capacity(64, 2, 0.3) == 6  # a fractional actor lives on one GPU: 3 per GPU, not 6.67
  assert actor_capacity(64, 8, 1 / 3) == 24  # 1/3 rounds below a third in floating point; still 3 per GPU
  assert actor_capacity(8, 0, 0.0) == 8  # CPU actors ignore GPUs
  assert actor_capacity(8, 0, 0.5) == 0


def test_hcq_runtimes_get_their_gpu_through_tinygrads_device_indices():
  from tinygrad.helpers import Target

  from offcar.replay_ray import hcq_target
  assert Target.parse(hcq_target("NV", [2]) or "").indices == "2" and Target.parse(hcq_target("NV", [2]) or "").device == "NV"
  assert Target.parse(hcq_target("AMD", ["0", "3"]) or "").indices == "0,3"
  assert hcq_target("CUDA", [1]) is None  # libcuda honours the CUDA_VISIBLE_DEVICES Ray sets
  assert hcq_target("NV", []) is None and hcq_target("CPU", [0]) is None
  assert hcq_target(":1+NV", [2]) is None  # the user already chose the GPU


def test_ray_packs_at_most_one_over_f_actors_per_gpu_and_sets_cuda_visible_devices(artifact, fake_gpu_ray):
  from offcar.replay_ray import ReplayWorker, actor_options
  cls = ray.remote(**actor_options("CUDA", 0.25))(ReplayWorker)
  actors = [cls.remote(str(artifact), "CUDA") for _ in range(6)]  # 8 CPUs would fit 6; the GPU fits 4
  refs = [a.where.remote() for a in actors]
  ready, waiting = ray.wait(refs, num_returns=6, timeout=60)
  if len(ready) < 4:  # a slow box: give the four that fit the time they need, then confirm the other two stay pending
    ready, waiting = ray.wait(refs, num_returns=4, timeout=120)
    ready, waiting = ray.wait(refs, num_returns=6, timeout=5)
  assert len(ready) == 4 and len(waiting) == 2
  placed = ray.get(ready)
  assert [(gpus, env) for _, gpus, env in placed] == [(["0"], "0")] * 4 and len({pid for pid, _, _ in placed}) == 4
  # one leaves: its quarter of the GPU goes to a waiting actor, which gets the same device
  ray.kill(actors[refs.index(ready[0])], no_restart=True)
  late, still = ray.wait(waiting, num_returns=1, timeout=120)
  assert len(late) == 1 and len(still) == 1 and ray.get(late[0])[1:] == (["0"], "0")
  # a CPU actor asks for no GPU and is given none
  cpu = ray.remote(**actor_options("CPU"))(ReplayWorker).remote(str(artifact), "CPU")
  assert ray.get(cpu.where.remote(), timeout=120)[1] == []


def test_replay_on_fake_gpus_uses_the_share_and_matches_serial(route, serial, artifact, fake_gpu_ray, monkeypatch, tmp_path):
  """The driver is told the artifact is a CUDA one (its workers still run the CPU artifact they load), so replay_ray sizes
  and places its actors by the GPU share: 0.5 -> 2 workers on the one GPU though 8 CPUs are free, outputs unchanged."""
  from offcar import replay_ray as rr
  monkeypatch.setattr(rr, "artifact_device", lambda a: "CUDA")
  segs = expand_segments([str(route)])
  run = rr.replay_ray(segs, artifact, tmp_path / "out", progress=False, gpus_per_actor=0.5)
  assert run.workers == 2 and run.gpus_per_actor == 0.5 and run.gpu_ids == [["0"], ["0"]]
  assert [r.error for r in run.results] == [None] * 8 and _outputs(tmp_path / "out") == _outputs(serial)
  with pytest.raises(UserError, match=r"room for 2 worker\(s\).*--jobs 2 or fewer"):
    rr.replay_ray(segs, artifact, tmp_path / "o2", jobs=3, progress=False, gpus_per_actor=0.5)
  default = rr.replay_ray(segs[:1], artifact, tmp_path / "o3", progress=False)  # default share for a GPU artifact: 1/4
  assert default.gpus_per_actor == 0.25 and default.workers == 1 and not default.results[0].error


def test_gpu_artifact_on_a_cluster_without_gpus_is_refused(route, artifact, local_ray, monkeypatch, tmp_path):
  from offcar import replay_ray as rr
  monkeypatch.setattr(rr, "artifact_device", lambda a: "CUDA")
  with pytest.raises(UserError, match="is for CUDA but the Ray cluster has no GPU"):
    rr.replay_ray(expand_segments([str(route)])[:1], artifact, tmp_path / "o", progress=False)


def test_artifact_device_reads_the_metadata(artifact, tmp_path):
  from offcar.replay_ray import artifact_device
  assert artifact_device(artifact) == "CPU"
  bundle = tmp_path / "bundle"
  for cam, dev in (("1344x760", "CUDA"), ("1928x1208", "CPU")):
    (bundle / cam).mkdir(parents=True)
    (bundle / cam / "metadata.json").write_text(json.dumps({"device": dev}))
  with pytest.raises(UserError, match="mixes devices"):
    artifact_device(bundle)
  with pytest.raises(UserError, match="has no metadata.json"):
    artifact_device(tmp_path)
