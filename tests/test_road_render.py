import math

import numpy as np
import pytest

from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.road_render import CAM_HEIGHT, FOCALS, RoadScene, _Sines
from selfdrive_glue.video import venus_planes


def _y(scene, buf):
  return venus_planes(buf, scene.info)[0]


def _straight(scene: RoadScene, curvature: float = 0.0) -> RoadScene:
  # near-constant curvature: one sinusoid with a 60 km wavelength, at its crest
  scene._kappa = _Sines([curvature], [2 * np.pi / 60000], [np.pi / 2])
  scene._wander = _Sines([0.0], [1.0], [0.0])
  return scene


@pytest.mark.parametrize("camera", ["1928x1208", "1344x760"])
def test_deterministic_from_seed_and_time(camera):
  a = RoadScene(5, camera).render(3.25, "road")
  b = RoadScene(5, camera).render(3.25, "road")
  assert a.size == nv12_info(*map(int, camera.split("x"))).size
  assert np.array_equal(a, b)
  assert not np.array_equal(a, RoadScene(6, camera).render(3.25, "road"))
  assert not np.array_equal(a, RoadScene(5, camera).render(3.30, "road"))  # the car moved
  assert not np.array_equal(a, RoadScene(5, camera).render(3.25, "wide"))


def test_render_order_does_not_matter():
  s = RoadScene(2, "1344x760")
  later = s.render(10.0)
  s.render(1.0, "wide")
  assert np.array_equal(s.render(10.0), later)


def test_writes_only_the_picture_not_the_padding():
  s = RoadScene(1, "1928x1208")
  info = s.info
  buf = np.full(info.size, 0xAB, np.uint8)
  s.render_into(buf, 2.0, "road")
  rows = buf[:info.stride * info.y_height].reshape(info.y_height, info.stride)
  assert (rows[:, s.width:] == 0xAB).all() and (rows[s.height:] == 0xAB).all()
  uv_rows = buf[info.uv_offset:info.uv_offset + info.stride * info.uv_height].reshape(info.uv_height, info.stride)
  assert (uv_rows[:, s.width:] == 0xAB).all() and (uv_rows[s.height // 2:] == 0xAB).all()
  assert (buf[info.uv_offset + info.stride * info.uv_height:] == 0xAB).all()
  y, uv = venus_planes(buf, info)
  assert (y != 0xAB).mean() > 0.99 and (uv != 0xAB).mean() > 0.99


def test_accepts_any_writable_buffer_and_rejects_small_ones():
  s = RoadScene(0, "1344x760")
  ba = bytearray(s.info.size)
  s.render_into(ba, 1.0)
  assert np.array_equal(np.frombuffer(ba, np.uint8), s.render(1.0))
  with pytest.raises(ValueError):
    s.render_into(np.zeros(s.info.size - 1, np.uint8), 0.0)
  with pytest.raises(ValueError):
    s.render_into(np.zeros(s.info.size, np.uint8), 0.0, "driver")
  with pytest.raises(ValueError):
    RoadScene(0, "1164x874")


@pytest.mark.parametrize("camera,which", [("1344x760", "road"), ("1928x1208", "road"), ("1928x1208", "wide")])
def test_solid_lane_lines_are_where_the_pinhole_camera_puts_them(camera, which):
  s = _straight(RoadScene(4, camera))
  s.has_lead = False
  assert s.focal(which) == FOCALS[camera][0 if which == "road" else 1]
  buf = s.render(0.0, which)
  y = _y(s, buf).astype(int)
  d = 12.0 if which == "wide" else 20.0
  for side in (-1.5, 1.5):  # the outer lines are solid
    lat = float(s._center_right(0.0, np.array([d]))[0]) + side * s.lane_width
    col, row = s._project(which, np.array([[d, lat, CAM_HEIGHT]]))[0]
    u, v = int(round(2 * col + 0.5)), int(round(2 * row + 0.5))
    assert 0 <= u < s.width and 0 <= v < s.height
    # the line is bright; mid-lane asphalt next to it is dark
    assert y[v, u - 1:u + 2].max() > 170, (side, y[v, u - 6:u + 6])
    lane_lat = lat - np.sign(side) * s.lane_width / 2
    c2, _ = s._project(which, np.array([[d, lane_lat, CAM_HEIGHT]]))[0]
    assert y[v, int(round(2 * c2 + 0.5))] < 130


def _road_middle_column(s: RoadScene, row: int) -> float:
  y = _y(s, s.render(0.0, "road")).astype(int)
  bright = np.nonzero(y[row] > 170)[0]
  assert len(bright) >= 2
  return (bright[0] + bright[-1]) / 2


def test_road_bends_the_way_the_curvature_says():
  # openpilot: positive curvature turns left; the far road then sits left (smaller column) of a straight one
  far_row = None
  cols = {}
  for k in (-1 / 400, 0.0, 1 / 400):
    s = _straight(RoadScene(8, "1928x1208"), k)
    s.has_lead = False
    if far_row is None:
      _, far_row = s._project("road", np.array([[60.0, 0.0, CAM_HEIGHT]]))[0]
      far_row = int(round(2 * far_row + 0.5))
    cols[k] = _road_middle_column(s, far_row)
    assert s.lane_center_column(0.0, 60.0) == pytest.approx(cols[k], abs=8)  # the helper agrees with the picture (row quantised)
  assert cols[1 / 400] < cols[0.0] - 50 < cols[-1 / 400] - 100


def test_lead_car_is_drawn_at_its_distance():
  s = _straight(RoadScene(3, "1928x1208"))
  assert s.has_lead
  e = s.ego(1.0)
  lat = float(s._center_right(1.0, np.array([e.lead_distance]))[0])
  col, row = s._project("road", np.array([[e.lead_distance, lat, CAM_HEIGHT - 0.4]]))[0]
  u, v = int(round(2 * col + 0.5)), int(round(2 * row + 0.5))
  with_lead = _y(s, s.render(1.0)).astype(int)
  s.has_lead = False
  without = _y(s, s.render(1.0)).astype(int)
  assert with_lead[v, u] < 70 < without[v, u]
  assert np.array_equal(with_lead[:, :50], without[:, :50])  # nothing else changed


def test_ego_state_is_consistent_over_time():
  s = RoadScene(12, "1928x1208")
  h = 1e-3
  blink = set()
  for t in np.linspace(0, 120, 241):
    e = s.ego(float(t))
    assert 5 < e.v_ego < 40
    dv = (s.ego(t + h).v_ego - s.ego(t - h).v_ego) / (2 * h)
    assert e.a_ego == pytest.approx(dv, abs=1e-4)
    assert e.yaw_rate == pytest.approx(e.curvature * e.v_ego)
    assert math.copysign(1, e.steering_angle_deg) == math.copysign(1, e.curvature) or abs(e.curvature) < 1e-9
    assert abs(e.curvature) < 0.02
    assert not (e.left_blinker and e.right_blinker)
    blink.add((e.left_blinker, e.right_blinker))
    if e.lead_distance is not None:
      assert e.lead_distance > 5
      dd = (s.ego(t + h).lead_distance - s.ego(t - h).lead_distance) / (2 * h)
      assert e.lead_v_rel == pytest.approx(dd, abs=1e-3)
  assert len(blink) >= 2  # blinkers come on at some point in two minutes
  # the renderer uses the same motion: the dashes move by the distance driven
  assert s._arc(2.0) - s._arc(1.0) == pytest.approx(np.mean([s.ego(t).v_ego for t in np.linspace(1, 2, 1001)]), rel=1e-3)


def test_calibration_is_small_roll_free_and_seeded():
  r = [RoadScene(i).calib_rpy for i in range(20)]
  assert all(c[0] == 0.0 and abs(c[1]) <= 0.03 and abs(c[2]) <= 0.02 for c in r)
  assert len(set(r)) == 20
