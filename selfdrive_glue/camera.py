"""Camera geometry: per-device intrinsics and the camera_from_model warp matrix modeld feeds its warp.

Frames: device (x forward, y right, z down), view (x right, y down, z forward), calib = device rotated by the
liveCalibration rpy. The warp maps model-frame pixels to camera pixels (no inversion needed by the warp kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from selfdrive_glue.errors import UserError


@dataclass(frozen=True)
class CameraConfig:
  width: int
  height: int
  focal_length: float

  @property
  def intrinsics(self) -> np.ndarray:
    # principal point at the exact centre (w/2, h/2)
    return np.array([[self.focal_length, 0.0, self.width / 2],
                     [0.0, self.focal_length, self.height / 2],
                     [0.0, 0.0, 1.0]])

  @property
  def size(self) -> tuple[int, int]:
    return (self.width, self.height)


@dataclass(frozen=True)
class DeviceCameraConfig:
  fcam: CameraConfig
  dcam: CameraConfig
  ecam: CameraConfig | None  # the neo had no wide camera


_ar_ox_fisheye = CameraConfig(1928, 1208, 567.0)
_os_fisheye = CameraConfig(1344, 760, 567.0 * 3 / 4)

_ar_ox = DeviceCameraConfig(fcam=CameraConfig(1928, 1208, 2648.0), dcam=_ar_ox_fisheye, ecam=_ar_ox_fisheye)
# os04c10 runs binned at 3/4 of the ar0231-equivalent focal lengths
_os = DeviceCameraConfig(fcam=CameraConfig(1344, 760, 1522.0 * 3 / 4), dcam=_os_fisheye, ecam=_os_fisheye)
_neo = DeviceCameraConfig(fcam=CameraConfig(1164, 874, 910.0), dcam=CameraConfig(816, 612, 650.0), ecam=None)

# keyed by (str(deviceState.deviceType), str(roadCameraState.sensor)), the capnp enum names
DEVICE_CAMERAS: dict[tuple[str, str], DeviceCameraConfig] = {
  ("neo", "unknown"): _neo,
  ("tici", "unknown"): _ar_ox,
  ("unknown", "ar0231"): _ar_ox,
  ("unknown", "ox03c10"): _ar_ox,
  ("pc", "unknown"): _ar_ox,
}
for _device in ("tici", "tizi", "mici"):
  DEVICE_CAMERAS[(_device, "ar0231")] = _ar_ox
  DEVICE_CAMERAS[(_device, "ox03c10")] = _ar_ox
  DEVICE_CAMERAS[(_device, "os04c10")] = _os


def sensor_and_device(camera: str) -> tuple[str, str]:
  """(sensor, deviceType) of the device that has this camera size: 1344x760 is the mici's os04c10, 1928x1208 a tici's ar0231."""
  return ("os04c10", "mici") if camera == "1344x760" else ("ar0231", "tici")


def device_camera_config(device_type: str, sensor: str) -> DeviceCameraConfig:
  try:
    return DEVICE_CAMERAS[(str(device_type), str(sensor))]
  except KeyError:
    known = ", ".join(f"{d}/{s}" for d, s in sorted(DEVICE_CAMERAS))
    raise UserError(f"no camera config for deviceType={device_type!r} sensor={sensor!r}; known pairs: {known}") from None


view_frame_from_device_frame = np.array([[0., 1., 0.],
                                         [0., 0., 1.],
                                         [1., 0., 0.]])
device_frame_from_view_frame = view_frame_from_device_frame.T

# model frames (512x256): medmodel for `img` (narrow, horizon high), sbigmodel for `big_img` (wide, half focal)
MEDMODEL_FL = 910.0
MEDMODEL_CY = 47.6
medmodel_intrinsics = np.array([[MEDMODEL_FL, 0.0, 0.5 * 512],
                                [0.0, MEDMODEL_FL, MEDMODEL_CY],
                                [0.0, 0.0, 1.0]])
SBIGMODEL_FL = MEDMODEL_FL / 2
sbigmodel_intrinsics = np.array([[SBIGMODEL_FL, 0.0, 0.5 * 512],
                                 [0.0, SBIGMODEL_FL, 0.5 * (256 + MEDMODEL_CY)],
                                 [0.0, 0.0, 1.0]])

calib_from_medmodel = np.linalg.inv(medmodel_intrinsics @ view_frame_from_device_frame)
calib_from_sbigmodel = np.linalg.inv(sbigmodel_intrinsics @ view_frame_from_device_frame)


def rot_from_euler(rpy) -> np.ndarray:
  """R = Rz(yaw) @ Ry(pitch) @ Rx(roll) for rpy = (roll, pitch, yaw) in radians."""
  rpy = np.asarray(rpy, dtype=np.float64)
  if rpy.shape != (3,):
    raise UserError(f"euler angles must be 3 values (roll, pitch, yaw), got shape {rpy.shape}")
  roll, pitch, yaw = rpy
  cr, sr, cp, sp, cy, sy = np.cos(roll), np.sin(roll), np.cos(pitch), np.sin(pitch), np.cos(yaw), np.sin(yaw)
  rx = np.array([[1., 0., 0.], [0., cr, -sr], [0., sr, cr]])
  ry = np.array([[cp, 0., sp], [0., 1., 0.], [-sp, 0., cp]])
  rz = np.array([[cy, -sy, 0.], [sy, cy, 0.], [0., 0., 1.]])
  return rz @ ry @ rx


def get_warp_matrix(device_from_calib_euler, intrinsics, bigmodel_frame: bool = False) -> np.ndarray:
  """camera_from_model (3x3 float64): K_cam @ view_from_device @ R(rpy) @ calib_from_{sbig,med}model."""
  intrinsics = np.asarray(intrinsics, dtype=np.float64)
  if intrinsics.shape != (3, 3):
    raise UserError(f"camera intrinsics must be 3x3, got shape {intrinsics.shape}")
  calib_from_model = calib_from_sbigmodel if bigmodel_frame else calib_from_medmodel
  camera_from_calib = intrinsics @ view_frame_from_device_frame @ rot_from_euler(device_from_calib_euler)
  return camera_from_calib @ calib_from_model


def model_transforms(rpy_calib, device_type: str, sensor: str, main_wide: bool) -> tuple[np.ndarray, np.ndarray]:
  """(main, extra) float32 warps for modeld: main = medmodel from fcam (ecam when the road camera is absent),
  extra = sbigmodel from ecam."""
  dc = device_camera_config(device_type, sensor)
  if dc.ecam is None:
    raise UserError(f"deviceType={device_type!r} has no wide camera; modeld needs one for big_img")
  main = get_warp_matrix(rpy_calib, (dc.ecam if main_wide else dc.fcam).intrinsics, False)
  extra = get_warp_matrix(rpy_calib, dc.ecam.intrinsics, True)
  return main.astype(np.float32), extra.astype(np.float32)


# driver monitoring: the driver camera warped to a 1440x960 image with the ar0231 fisheye's focal length, centred on
# the camera's centre less the rows the 1208-high sensor has beyond 960 (openpilot's DM contract)
DM_INPUT_SIZE = (1440, 960)
dm_intrinsics = np.array([[567.0, 0.0, DM_INPUT_SIZE[0] / 2],
                          [0.0, 567.0, DM_INPUT_SIZE[1] / 2 - (1208 - DM_INPUT_SIZE[1]) / 2],
                          [0.0, 0.0, 1.0]])


def dm_warp_matrix(width: int) -> np.ndarray:
  """camera_from_dm (3x3 float32), the matrix the DM warp samples with: inv(K_dm @ inv(K_cam)) for the driver camera of a
  frame `width` wide (1344: the mici's os04c10 fisheye, any other: the ar0231/ox03c10 fisheye), as dmonitoringmodeld
  computes it from its first frame."""
  cam = _os_fisheye if width == _os_fisheye.width else _ar_ox_fisheye
  return np.linalg.inv(dm_intrinsics @ np.linalg.inv(cam.intrinsics)).astype(np.float32)
