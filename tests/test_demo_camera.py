"""The demo's camera process paces frames by --period-ms (the level-B soak offers frames at a rate the emulator follows)."""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _camera(*args, timeout=60):
  env = {**os.environ, "OPENPILOT_PREFIX": f"cam{uuid.uuid4().hex[:6]}"}
  t = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "offcar.demo_camera", "--camera", "1928x1208", *args], capture_output=True, text=True,
                     cwd=REPO, env=env, timeout=timeout)
  return r, time.monotonic() - t


def test_period_sets_the_frame_rate(tmp_path):
  stats = tmp_path / "stats.json"
  r, wall = _camera("--seconds", "1.5", "--period-ms", "250", "--stats", str(stats))
  assert r.returncode == 0, r.stderr
  assert json.loads(stats.read_text())["frames_sent"] == 6   # 1.5 s / 250 ms, not 30 at 20 Hz
  assert wall >= 1.5


def test_a_period_that_is_not_positive_is_refused():
  r, _ = _camera("--seconds", "1", "--period-ms", "0")
  assert r.returncode == 2 and "--period-ms must be > 0" in r.stderr
