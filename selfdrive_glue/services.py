"""openpilot 0.11's service table (cereal/services.py): name -> (should_log, hz, qlog_decimation, queue_size).

queue_size is the msgq segment size in bytes; every party opening a queue must use the same one, because opening
re-truncates the shared file."""
from __future__ import annotations

from typing import NamedTuple

SMALL = 250 * 1024   # the default
MEDIUM = 2 * 1024 * 1024
BIG = 10 * 1024 * 1024
DEFAULT_SEGMENT_SIZE = 1024 * 1024  # msgq's own default, used for names not in the table (e.g. VisionIPC notifications)


class Service(NamedTuple):
  should_log: bool
  frequency: float
  decimation: int | None
  queue_size: int


# name: (should_log, hz, qlog decimation or None, queue size)
_TABLE: dict[str, tuple[bool, float, int | None, int]] = {
  "gyroscope": (True, 104., 104, SMALL), "accelerometer": (True, 104., 104, SMALL), "magnetometer": (True, 25., None, SMALL),
  "lightSensor": (True, 100., 100, SMALL), "temperatureSensor": (True, 2., 200, SMALL), "gpsNMEA": (True, 9., None, SMALL),
  "deviceState": (True, 2., 1, SMALL), "touch": (True, 20., 1, SMALL), "can": (True, 100., 2053, BIG),
  "controlsState": (True, 100., 10, MEDIUM), "selfdriveState": (True, 100., 10, SMALL), "pandaStates": (True, 10., 1, SMALL),
  "peripheralState": (True, 2., 1, SMALL), "radarState": (True, 20., 5, SMALL), "roadEncodeIdx": (False, 20., 1, SMALL),
  "liveTracks": (True, 20., None, SMALL), "sendcan": (True, 100., 139, MEDIUM), "logMessage": (True, 0., None, SMALL),
  "errorLogMessage": (True, 0., 1, SMALL), "liveCalibration": (True, 4., 4, SMALL), "liveTorqueParameters": (True, 4., 1, SMALL),
  "liveDelay": (True, 4., 1, SMALL), "androidLog": (True, 0., None, SMALL), "carState": (True, 100., 10, SMALL),
  "carControl": (True, 100., 10, SMALL), "carOutput": (True, 100., 10, SMALL), "longitudinalPlan": (True, 20., 10, SMALL),
  "driverAssistance": (True, 20., 20, SMALL), "procLog": (True, 0.5, 15, BIG), "gpsLocationExternal": (True, 10., 10, SMALL),
  "gpsLocation": (True, 1., 1, SMALL), "ubloxGnss": (True, 10., None, SMALL), "qcomGnss": (True, 2., None, SMALL),
  "gnssMeasurements": (True, 10., 10, SMALL), "clocks": (True, 0.1, 1, SMALL), "ubloxRaw": (True, 20., None, SMALL),
  "livePose": (True, 20., 4, SMALL), "liveParameters": (True, 20., 5, SMALL), "cameraOdometry": (True, 20., 10, SMALL),
  "thumbnail": (True, 1 / 60., 1, SMALL), "onroadEvents": (True, 1., 1, SMALL), "carParams": (True, 0.02, 1, SMALL),
  "roadCameraState": (True, 20., 20, SMALL), "driverCameraState": (True, 20., 20, SMALL), "driverEncodeIdx": (False, 20., 1, SMALL),
  "driverStateV2": (True, 20., 10, SMALL), "driverMonitoringState": (True, 20., 10, SMALL), "wideRoadEncodeIdx": (False, 20., 1, SMALL),
  "wideRoadCameraState": (True, 20., 20, SMALL), "drivingModelData": (True, 20., 10, SMALL), "modelV2": (True, 20., None, BIG),
  "managerState": (True, 2., 1, SMALL), "uploaderState": (True, 0., 1, SMALL), "navInstruction": (True, 1., 10, SMALL),
  "navRoute": (True, 0., None, SMALL), "navThumbnail": (True, 0., None, SMALL), "qRoadEncodeIdx": (False, 20., None, SMALL),
  "userBookmark": (True, 0., 1, SMALL), "soundPressure": (True, 10., 10, SMALL), "rawAudioData": (False, 20., None, SMALL),
  "bookmarkButton": (True, 0., 1, SMALL), "audioFeedback": (True, 0., 1, SMALL),
  "roadEncodeData": (False, 20., None, BIG), "driverEncodeData": (False, 20., None, BIG), "wideRoadEncodeData": (False, 20., None, BIG),
  "qRoadEncodeData": (False, 20., None, BIG), "uiDebug": (True, 0., 1, SMALL), "testJoystick": (True, 0., None, SMALL),
  "alertDebug": (True, 20., 5, SMALL),
  "livestreamWideRoadEncodeIdx": (False, 20., None, SMALL), "livestreamRoadEncodeIdx": (False, 20., None, SMALL),
  "livestreamDriverEncodeIdx": (False, 20., None, SMALL), "livestreamWideRoadEncodeData": (False, 20., None, MEDIUM),
  "livestreamRoadEncodeData": (False, 20., None, MEDIUM), "livestreamDriverEncodeData": (False, 20., None, MEDIUM),
  "customReservedRawData0": (True, 0., None, SMALL), "customReservedRawData1": (True, 0., None, SMALL),
  "customReservedRawData2": (True, 0., None, SMALL),
}

# openpilot master's names since PRs #38585 and #38601 (2026-08): new name -> 0.11's. Each is a rename of the service and of
# its Event member, which keeps its ordinal and type (cereal renames in place; the PR leaves the on-disk names that would
# need compatibility to a later pass), so the bytes are 0.11's and only the queue's name differs. A queue of each name,
# with the old one's rate and size (docs/openpilot-master-2026-09.md).
RENAMED = {
  "narrowRoadCameraState": "roadCameraState", "cabinCameraState": "driverCameraState", "narrowRoadEncodeIdx": "roadEncodeIdx",
  "narrowRoadEncodeData": "roadEncodeData", "qNarrowRoadEncodeIdx": "qRoadEncodeIdx", "qNarrowRoadEncodeData": "qRoadEncodeData",
  "livestreamNarrowRoadEncodeIdx": "livestreamRoadEncodeIdx", "livestreamNarrowRoadEncodeData": "livestreamRoadEncodeData",
  "cabinEncodeIdx": "driverEncodeIdx", "cabinEncodeData": "driverEncodeData", "livestreamCabinEncodeIdx": "livestreamDriverEncodeIdx",
  "livestreamCabinEncodeData": "livestreamDriverEncodeData",
  "radarTracks": "liveTracks", "extrinsicsCalibration": "liveCalibration", "lateralTorqueParameters": "liveTorqueParameters",
  "lateralDelay": "liveDelay", "deviceMotion": "livePose", "vehicleParameters": "liveParameters",
}
_TABLE.update({new: _TABLE[old] for new, old in RENAMED.items()})

SERVICE_LIST: dict[str, Service] = {name: Service(*v) for name, v in _TABLE.items()}
# the tuple form the team's interface names: name -> (should_log, hz, qlog_decimation, queue_size)
SERVICES: dict[str, tuple[bool, float, int | None, int]] = dict(_TABLE)


def segment_size(name: str) -> int:
  """Bytes of ring buffer for a msgq endpoint: the service's queue size, msgq's default for anything else."""
  svc = SERVICE_LIST.get(name)
  return svc.queue_size if svc is not None else DEFAULT_SEGMENT_SIZE
