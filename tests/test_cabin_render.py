"""The rendered cabin shows what its truth says: a face or none, eyes open or closed, sunglasses, the head turned."""
from __future__ import annotations

import numpy as np

from compile.programs.dm_warp import warp_y_numpy
from selfdrive_glue.cabin_render import CabinScene
from selfdrive_glue.camera import dm_warp_matrix


def _find(scene: CabinScene, want, step: float = 0.05, end: float = 120.0) -> float:
  return next(t for t in np.arange(0, end, step) if want(scene.truth(float(t))))


def _y(scene: CabinScene, t: float) -> np.ndarray:
  info = scene.info
  return scene.render(t)[:info.stride * info.height].reshape(info.height, info.stride)[:, :info.width]


def test_the_same_seed_and_time_render_the_same_frame_and_others_differ():
  a, b = CabinScene(4), CabinScene(4)
  assert np.array_equal(a.render(3.2), b.render(3.2)) and not np.array_equal(a.render(3.2), CabinScene(5).render(3.2))
  assert not np.array_equal(a.render(3.2), a.render(3.4))


def test_no_face_means_no_bright_head_in_the_picture():
  s = CabinScene(1)
  face, none = _find(s, lambda tr: tr.face), _find(s, lambda tr: not tr.face)
  assert (_y(s, face) > 120).sum() > 20_000 and (_y(s, none) > 120).sum() == 0


def test_closed_eyes_and_sunglasses_change_the_eyes_region():
  s = CabinScene(2)
  shut = _find(s, lambda tr: tr.face and tr.eyes_closed and not tr.sunglasses, step=0.01)
  dark = lambda t: int((_y(s, t) == 25).sum())  # noqa: E731  (the eyes are drawn at 25, nothing else is)
  assert dark(shut) < dark(shut - 0.3) / 3   # an open eye a moment before is a dark ellipse, a shut one a line
  glasses = _find(s, lambda tr: tr.face and tr.sunglasses and not tr.eyes_closed)
  assert (_y(s, glasses) == 18).sum() > 5_000 and (_y(s, shut) == 18).sum() == 0


def test_the_features_move_with_the_truths_yaw_and_pitch():
  """Where the pupils sit relative to the head's outline follows yaw (sideways) and pitch (up and down)."""
  s = CabinScene(3)
  ts = [float(t) for t in np.arange(0, 8, 0.25) if s.truth(float(t)).face and not s.truth(float(t)).eyes_closed and not s.truth(float(t)).sunglasses]
  du, dv, yaw, pitch = [], [], [], []
  for t in ts:
    img = warp_y_numpy(s.render(t), dm_warp_matrix(1928), s.info, 1440, 960).reshape(960, 1440)
    head = np.argwhere(img > 60)
    eyes = np.argwhere(img == 25)
    dv.append(eyes[:, 0].mean() - head[:, 0].mean())
    du.append(eyes[:, 1].mean() - head[:, 1].mean())
    tr = s.truth(t)
    yaw.append(tr.yaw)
    pitch.append(tr.pitch)
  assert np.corrcoef(du, yaw)[0, 1] > 0.9 and np.corrcoef(dv, pitch)[0, 1] > 0.9


def _eyes_offset(img: np.ndarray) -> np.ndarray:
  head, eyes = np.argwhere(img > 60), np.argwhere(img == 25)
  return eyes.mean(0) - head.mean(0)


def test_the_camera_sees_the_head_turned_by_the_calibration():
  """The truth is the car's frame; a camera mounted with calib pitch/yaw sees the head at truth + calib, exactly as a
  zero-calibration camera sees a head turned that much more (the inverse of dmonitoringd's correction)."""
  calib = (0.0, 0.08, -0.06)
  s, mounted = CabinScene(3), CabinScene(3, calib_rpy=calib)
  t = _find(s, lambda tr: tr.face and not tr.eyes_closed and not tr.sunglasses)
  assert mounted.truth(t) == s.truth(t)
  shift = _eyes_offset(_y(mounted, t)) - _eyes_offset(_y(s, t))
  assert shift[0] > 5 and shift[1] < -5   # more pitch (looking down): features lower; less yaw: features to the image's left
  none = _find(s, lambda tr: not tr.face)
  assert np.array_equal(mounted.render(none), s.render(none))   # an empty seat looks the same from any mount
