import numpy as np
import pytest

from selfdrive_glue.camera import (
  DEVICE_CAMERAS,
  device_camera_config,
  get_warp_matrix,
  medmodel_intrinsics,
  model_transforms,
  rot_from_euler,
  sbigmodel_intrinsics,
  view_frame_from_device_frame,
)
from selfdrive_glue.errors import UserError

# contract §7: zero-calibration warp = diag(s, s, 1) + translation (tx, ty)
SANITY = [
  (("tici", "ar0231"), "fcam", False, 2.90989, 219.068, 465.489),
  (("tici", "ar0231"), "ecam", True, 1.24615, 644.985, 414.834),
  (("mici", "os04c10"), "fcam", False, 1.2544, 350.875, 320.291),
  (("mici", "os04c10"), "ecam", True, 0.93462, 432.738, 238.125),
]


@pytest.mark.parametrize("key,cam,big,s,tx,ty", SANITY)
def test_zero_calibration_sanity_values(key, cam, big, s, tx, ty):
  m = get_warp_matrix(np.zeros(3), getattr(DEVICE_CAMERAS[key], cam).intrinsics, big)
  assert m.shape == (3, 3)
  np.testing.assert_allclose(np.diag(m), [s, s, 1.0], rtol=2e-5)
  np.testing.assert_allclose(m[:2, 2], [tx, ty], atol=1e-3)
  np.testing.assert_allclose([m[0, 1], m[1, 0], m[2, 0], m[2, 1]], 0, atol=1e-12)


def _apply(m, x, y):
  p = m @ np.array([x, y, 1.0])
  return p[:2] / p[2]


@pytest.mark.parametrize("big", [False, True])
def test_model_principal_point_maps_to_camera_principal_point(big):
  cam = DEVICE_CAMERAS[("tici", "ox03c10")].fcam
  k_model = sbigmodel_intrinsics if big else medmodel_intrinsics
  m = get_warp_matrix([0.0, 0.0, 0.0], cam.intrinsics, big)
  np.testing.assert_allclose(_apply(m, k_model[0, 2], k_model[1, 2]), [cam.width / 2, cam.height / 2], atol=1e-9)


def test_calibration_rotates_the_view():
  cam = DEVICE_CAMERAS[("tici", "ar0231")].fcam
  k = cam.intrinsics
  pp = (medmodel_intrinsics[0, 2], medmodel_intrinsics[1, 2])
  # yaw to the right: the model's centre ray looks right of the camera centre by tan(yaw) * f
  yaw = 0.02
  x, y = _apply(get_warp_matrix([0, 0, yaw], k), *pp)
  assert x == pytest.approx(k[0, 2] + k[0, 0] * np.tan(yaw), rel=1e-9)
  assert y == pytest.approx(k[1, 2], abs=1e-9)
  # pitch up (positive pitch rotates x toward -z = up): centre ray lands above the camera centre
  pitch = 0.03
  x, y = _apply(get_warp_matrix([0, pitch, 0], k), *pp)
  assert x == pytest.approx(k[0, 2], abs=1e-9)
  assert y == pytest.approx(k[1, 2] - k[1, 1] * np.tan(pitch), rel=1e-9)
  # roll keeps the centre ray and rotates everything around it
  m = get_warp_matrix([0.05, 0, 0], k)
  np.testing.assert_allclose(_apply(m, *pp), [k[0, 2], k[1, 2]], atol=1e-9)
  off = _apply(m, pp[0] + 100, pp[1]) - np.array([k[0, 2], k[1, 2]])
  assert np.arctan2(off[1], off[0]) == pytest.approx(0.05, abs=1e-9)


@pytest.mark.parametrize("rpy", [(0.1, -0.2, 0.3), (-1.0, 0.5, 2.0), (0, 0, 0)])
def test_rotation_is_orthonormal_and_composes(rpy):
  r = rot_from_euler(rpy)
  np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-12)
  assert np.linalg.det(r) == pytest.approx(1.0)
  roll, pitch, yaw = rpy
  np.testing.assert_allclose(r, rot_from_euler([0, 0, yaw]) @ rot_from_euler([0, pitch, 0]) @ rot_from_euler([roll, 0, 0]), atol=1e-12)
  # yaw alone turns forward (x) toward right (y)
  np.testing.assert_allclose(rot_from_euler([0, 0, np.pi / 2]) @ [1, 0, 0], [0, 1, 0], atol=1e-12)


def test_view_from_device_axes():
  # device x forward -> view z, device y right -> view x, device z down -> view y
  np.testing.assert_array_equal(view_frame_from_device_frame @ [1, 0, 0], [0, 0, 1])
  np.testing.assert_array_equal(view_frame_from_device_frame @ [0, 1, 0], [1, 0, 0])
  np.testing.assert_array_equal(view_frame_from_device_frame @ [0, 0, 1], [0, 1, 0])


def test_model_intrinsics():
  assert medmodel_intrinsics[0, 0] == 910 and tuple(medmodel_intrinsics[:2, 2]) == (256, 47.6)
  assert sbigmodel_intrinsics[0, 0] == 455 and tuple(sbigmodel_intrinsics[:2, 2]) == (256, pytest.approx(151.8))


def test_device_cameras_table():
  for dev in ("tici", "tizi", "mici"):
    assert DEVICE_CAMERAS[(dev, "ar0231")] is DEVICE_CAMERAS[(dev, "ox03c10")]
    assert DEVICE_CAMERAS[(dev, "os04c10")].fcam.size == (1344, 760)
    assert DEVICE_CAMERAS[(dev, "ar0231")].fcam.size == (1928, 1208)
  for key in [("tici", "unknown"), ("unknown", "ar0231"), ("unknown", "ox03c10"), ("pc", "unknown")]:
    assert DEVICE_CAMERAS[key].fcam.focal_length == 2648.0
    assert DEVICE_CAMERAS[key].ecam.focal_length == 567.0
  os = DEVICE_CAMERAS[("mici", "os04c10")]
  assert os.fcam.focal_length == 1141.5 and os.ecam.focal_length == 425.25 and os.dcam == os.ecam
  neo = DEVICE_CAMERAS[("neo", "unknown")]
  assert neo.ecam is None and neo.fcam.size == (1164, 874) and neo.dcam.focal_length == 650.0
  k = os.fcam.intrinsics
  np.testing.assert_array_equal(k, [[1141.5, 0, 672], [0, 1141.5, 380], [0, 0, 1]])


def test_unknown_device_is_a_user_error():
  assert device_camera_config("tizi", "os04c10") is DEVICE_CAMERAS[("tizi", "os04c10")]
  with pytest.raises(UserError, match="deviceType='tizi' sensor='imx999'"):
    device_camera_config("tizi", "imx999")
  with pytest.raises(UserError):
    get_warp_matrix([0, 0], np.eye(3))
  with pytest.raises(UserError):
    get_warp_matrix([0, 0, 0], np.eye(2))


def test_model_transforms_for_modeld():
  rpy = [0.01, -0.02, 0.03]
  main, extra = model_transforms(rpy, "tici", "ar0231", main_wide=False)
  assert main.dtype == np.float32 and extra.dtype == np.float32
  dc = DEVICE_CAMERAS[("tici", "ar0231")]
  np.testing.assert_array_equal(main, get_warp_matrix(rpy, dc.fcam.intrinsics, False).astype(np.float32))
  np.testing.assert_array_equal(extra, get_warp_matrix(rpy, dc.ecam.intrinsics, True).astype(np.float32))
  wide_main, wide_extra = model_transforms(rpy, "mici", "os04c10", main_wide=True)
  dc = DEVICE_CAMERAS[("mici", "os04c10")]
  np.testing.assert_array_equal(wide_main, get_warp_matrix(rpy, dc.ecam.intrinsics, False).astype(np.float32))
  assert not np.array_equal(wide_main, wide_extra)
  with pytest.raises(UserError, match="no wide camera"):
    model_transforms(rpy, "neo", "unknown", main_wide=False)
