# modeld-msm's own cereal schema: the subset of openpilot 0.11's messages that modeld reads and writes.
# Wire-compatible with openpilot: every field keeps openpilot's ordinal and type size, and each ordinal we do not
# use is held by an `unusedN` placeholder (or an AnyPointer union member under openpilot's name) of the same size,
# so field offsets and union discriminants are identical. Structs stop after the last ordinal we need; later
# upstream fields are simply ignored. File and struct ids differ from openpilot's on purpose, so both schemas can be
# loaded into one process (tests compare them). tests/test_schema_compat.py checks the layout against the reference.

@0x8454cb6940627def;

using Car = import "car.capnp";

struct Event {
  logMonoTime @0 :UInt64;
  union {
    initData @1 :InitData;
    roadCameraState @2 :FrameData;   # master's narrowRoadCameraState (same ordinal: selfdrive_glue/services.py RENAMED)
    gpsNMEA @3 :AnyPointer;
    sensorEventDEPRECATED @4 :AnyPointer;
    can @5 :AnyPointer;
    deviceState @6 :DeviceState;
    controlsState @7 :AnyPointer;
    liveEventDEPRECATED @8 :AnyPointer;
    model @9 :AnyPointer;
    featuresDEPRECATED @10 :AnyPointer;
    sensorEventsDEPRECATED @11 :AnyPointer;
    pandaStateDEPRECATED @12 :AnyPointer;
    radarState @13 :AnyPointer;
    liveUIDEPRECATED @14 :AnyPointer;
    roadEncodeIdx @15 :EncodeIndex;
    liveTracksDEPRECATED @16 :AnyPointer;
    sendcan @17 :AnyPointer;
    logMessage @18 :AnyPointer;
    liveCalibration @19 :LiveCalibrationData;   # master's extrinsicsCalibration (same ordinal: selfdrive_glue/services.py RENAMED)
    androidLog @20 :AnyPointer;
    gpsLocation @21 :AnyPointer;
    carState @22 :Car.CarState;
    carControl @23 :Car.CarControl;
    longitudinalPlan @24 :AnyPointer;
    liveLocationDEPRECATED @25 :AnyPointer;
    ethernetDataDEPRECATED @26 :AnyPointer;
    navUpdateDEPRECATED @27 :AnyPointer;
    cellInfoDEPRECATED @28 :AnyPointer;
    wifiScanDEPRECATED @29 :AnyPointer;
    androidGnssDEPRECATED @30 :AnyPointer;
    qcomGnss @31 :AnyPointer;
    lidarPtsDEPRECATED @32 :AnyPointer;
    procLog @33 :AnyPointer;
    ubloxGnss @34 :AnyPointer;
    clocks @35 :AnyPointer;
    liveMpcDEPRECATED @36 :AnyPointer;
    liveLongitudinalMpcDEPRECATED @37 :AnyPointer;
    navStatusDEPRECATED @38 :AnyPointer;
    ubloxRaw @39 :AnyPointer;
    gpsPlannerPointsDEPRECATED @40 :AnyPointer;
    gpsPlannerPlanDEPRECATED @41 :AnyPointer;
    applanixRawDEPRECATED @42 :AnyPointer;
    trafficEventsDEPRECATED @43 :AnyPointer;
    liveLocationTimingDEPRECATED @44 :AnyPointer;
    orbslamCorrectionDEPRECATED @45 :AnyPointer;
    liveLocationCorrectedDEPRECATED @46 :AnyPointer;
    orbObservationDEPRECATED @47 :AnyPointer;
    gpsLocationExternal @48 :AnyPointer;
    locationDEPRECATED @49 :AnyPointer;
    uiNavigationEventDEPRECATED @50 :AnyPointer;
    liveLocationKalmanLegacyDEPRECATED @51 :AnyPointer;
    testJoystick @52 :AnyPointer;
    orbOdometryDEPRECATED @53 :AnyPointer;
    orbFeaturesDEPRECATED @54 :AnyPointer;
    applanixLocationDEPRECATED @55 :AnyPointer;
    orbKeyFrameDEPRECATED @56 :AnyPointer;
    uiLayoutStateDEPRECATED @57 :AnyPointer;
    orbFeaturesSummaryDEPRECATED @58 :AnyPointer;
    driverStateDEPRECATED @59 :AnyPointer;
    boot @60 :AnyPointer;
    liveParameters @61 :AnyPointer;
    liveMapDataDEPRECATED @62 :AnyPointer;
    cameraOdometry @63 :CameraOdometry;
    lateralPlanDEPRECATED @64 :AnyPointer;
    kalmanOdometryDEPRECATED @65 :AnyPointer;
    thumbnail @66 :AnyPointer;
    onroadEventsDEPRECATED @68 :AnyPointer;
    carParams @69 :Car.CarParams;
    driverCameraState @70 :FrameData;   # master's cabinCameraState (same ordinal: selfdrive_glue/services.py RENAMED)
    driverMonitoringState @71 :DriverMonitoringState;
    liveLocationKalmanDEPRECATED @72 :AnyPointer;
    sentinel @73 :AnyPointer;
    wideRoadCameraState @74 :FrameData;
    modelV2 @75 :ModelDataV2;
    driverEncodeIdx @76 :EncodeIndex;
    wideRoadEncodeIdx @77 :EncodeIndex;
    managerState @78 :AnyPointer;
    uploaderState @79 :AnyPointer;
    peripheralState @80 :AnyPointer;
    pandaStates @81 :AnyPointer;
    navInstruction @82 :AnyPointer;
    navRoute @83 :AnyPointer;
    navThumbnail @84 :AnyPointer;
    errorLogMessage @85 :AnyPointer;
    roadEncodeData @86 :AnyPointer;
    driverEncodeData @87 :AnyPointer;
    wideRoadEncodeData @88 :AnyPointer;
    qRoadEncodeData @89 :AnyPointer;
    qRoadEncodeIdx @90 :AnyPointer;
    gnssMeasurements @91 :AnyPointer;
    driverStateV2 @92 :DriverStateV2;
    userBookmark @93 :AnyPointer;
    liveTorqueParameters @94 :AnyPointer;
    magnetometer @95 :AnyPointer;
    lightSensor @96 :AnyPointer;
    temperatureSensor @97 :AnyPointer;
    accelerometer @98 :AnyPointer;
    gyroscope @99 :AnyPointer;
    gyroscope2DEPRECATED @100 :AnyPointer;
    accelerometer2DEPRECATED @101 :AnyPointer;
    uiDebug @102 :AnyPointer;
    soundPressure @103 :AnyPointer;
    navModelDEPRECATED @104 :AnyPointer;
    mapRenderState @105 :AnyPointer;
    uiPlanDEPRECATED @106 :AnyPointer;
    customReserved0 @107 :AnyPointer;
    customReserved1 @108 :AnyPointer;
    customReserved2 @109 :AnyPointer;
    customReserved3 @110 :AnyPointer;
    customReserved4 @111 :AnyPointer;
    customReserved5 @112 :AnyPointer;
    customReserved6 @113 :AnyPointer;
    customReserved7 @114 :AnyPointer;
    customReserved8 @115 :AnyPointer;
    customReserved9 @116 :AnyPointer;
    livestreamRoadEncodeIdx @117 :AnyPointer;
    livestreamWideRoadEncodeIdx @118 :AnyPointer;
    livestreamDriverEncodeIdx @119 :AnyPointer;
    livestreamRoadEncodeData @120 :AnyPointer;
    livestreamWideRoadEncodeData @121 :AnyPointer;
    livestreamDriverEncodeData @122 :AnyPointer;
    temperatureSensor2DEPRECATED @123 :AnyPointer;
    customReservedRawData0 @124 :AnyPointer;
    customReservedRawData1 @125 :AnyPointer;
    customReservedRawData2 @126 :AnyPointer;
    carOutput @127 :AnyPointer;
    drivingModelData @128 :DrivingModelData;
    livePose @129 :AnyPointer;
    selfdriveState @130 :AnyPointer;
    liveTracks @131 :AnyPointer;
    driverAssistance @132 :AnyPointer;
    alertDebug @133 :AnyPointer;
    onroadEvents @134 :AnyPointer;
    touch @135 :AnyPointer;
    customReserved10 @136 :AnyPointer;
    customReserved11 @137 :AnyPointer;
    customReserved12 @138 :AnyPointer;
    customReserved13 @139 :AnyPointer;
    customReserved14 @140 :AnyPointer;
    customReserved15 @141 :AnyPointer;
    customReserved16 @142 :AnyPointer;
    customReserved17 @143 :AnyPointer;
    customReserved18 @144 :AnyPointer;
    customReserved19 @145 :AnyPointer;
    liveDelay @146 :LiveDelayData;   # master's lateralDelay (same ordinal: selfdrive_glue/services.py RENAMED)
    rawAudioData @147 :AnyPointer;
    bookmarkButton @148 :AnyPointer;
    audioFeedback @149 :AnyPointer;
    lateralManeuverPlan @150 :AnyPointer;
    driverMonitoringStateV2 @151 :DriverMonitoringStateV2;
  }
  valid @67 :Bool = true;
}

struct InitData {
  kernelArgs @0 :List(Text);
  unused1 @1 :AnyPointer;
  dongleId @2 :Text;
  deviceType @3 :DeviceType;
  version @4 :Text;
  unused5 @5 :AnyPointer;
  unused6 @6 :AnyPointer;
  unused7 @7 :AnyPointer;
  pandaInfo @8 :PandaInfo;
  dirty @9 :Bool;
  gitCommit @10 :Text;
  gitBranch @11 :Text;
  passive @12 :Bool;
  gitRemote @13 :Text;
  unused14 @14 :AnyPointer;
  kernelVersion @15 :Text;
  unused16 @16 :AnyPointer;
  unused17 @17 :AnyPointer;
  osVersion @18 :Text;
  unused19 @19 :AnyPointer;
  wallTimeNanos @20 :UInt64;
  gitCommitDate @21 :Text;
  bootlogId @22 :Text;
  gitSrcCommit @23 :Text;
  gitSrcCommitDate @24 :Text;
  struct PandaInfo {
    hasPanda @0 :Bool;
    dongleId @1 :Text;
    stVersion @2 :Text;
    espVersion @3 :Text;
  }

  enum DeviceType {
    unknown @0;
    neo @1;
    chffrAndroid @2;
    chffrIos @3;
    tici @4;
    pc @5;
    tizi @6;
    mici @7;
  }

}

struct FrameData {
  frameId @0 :UInt32;
  encodeId @1 :UInt32;
  timestampEof @2 :UInt64;
  unused3 @3 :UInt32;
  integLines @4 :Int32;
  unused5 @5 :UInt32;
  image @6 :Data;
  unused7 @7 :UInt16;
  timestampSof @8 :UInt64;
  unused9 @9 :AnyPointer;
  transform @10 :List(Float32);
  unused11 @11 :UInt32;
  unused12 @12 :UInt32;
  unused13 @13 :UInt32;
  unused14 @14 :UInt32;
  gain @15 :Float32;
  unused16 @16 :AnyPointer;
  unused17 @17 :AnyPointer;
  unused18 @18 :AnyPointer;
  unused19 @19 :UInt32;
  highConversionGain @20 :Bool;
  measuredGreyFraction @21 :Float32;
  targetGreyFraction @22 :Float32;
  processingTime @23 :Float32;
  temperaturesC @24 :List(Float32);
  frameIdSensor @25 :UInt32;
  sensor @26 :ImageSensor;
  exposureValPercent @27 :Float32;
  requestId @28 :UInt32;
  enum ImageSensor {
    unknown @0;
    ar0231 @1;
    ox03c10 @2;
    os04c10 @3;
  }

}

# One encoded camera frame: which camera frame it is and where it sits in the segment's video file. Replay maps
# camera states to video frames through it (modeld_msm/replay.py).
struct EncodeIndex {
  frameId @0 :UInt32;
  type @1 :Type;
  encodeId @2 :UInt32;
  segmentNum @3 :Int32;
  segmentId @4 :UInt32;
  segmentIdEncode @5 :UInt32;
  timestampSof @6 :UInt64;
  timestampEof @7 :UInt64;
  flags @8 :UInt32;
  len @9 :UInt32;
  enum Type {
    bigBoxLossless @0;
    fullHEVC @1;
    bigBoxHEVCDEPRECATED @2;
    chffrAndroidH264DEPRECATED @3;
    fullLosslessClipDEPRECATED @4;
    frontDEPRECATED @5;
    qcameraH264 @6;
    livestreamH264 @7;
  }

}

struct DeviceState {
  unused0 @0 :UInt16;
  unused1 @1 :UInt16;
  unused2 @2 :UInt16;
  unused3 @3 :UInt16;
  unused4 @4 :UInt16;
  unused5 @5 :UInt16;
  unused6 @6 :UInt32;
  freeSpacePercent @7 :Float32;
  unused8 @8 :UInt16;
  unused9 @9 :AnyPointer;
  unused10 @10 :UInt16;
  started @11 :Bool;
  unused12 @12 :Bool;
  startedMonoTime @13 :UInt64;
  thermalStatus @14 :ThermalStatus;
  unused15 @15 :UInt32;
  unused16 @16 :UInt32;
  unused17 @17 :Bool;
  unused18 @18 :Bool;
  memoryUsagePercent @19 :Int8;
  unused20 @20 :UInt8;
  unused21 @21 :UInt16;
  unused22 @22 :UInt16;
  unused23 @23 :UInt32;
  unused24 @24 :UInt16;
  unused25 @25 :UInt32;
  cpuTempC @26 :List(Float32);
  gpuTempC @27 :List(Float32);
  memoryTempC @28 :Float32;
  unused29 @29 :UInt32;
  unused30 @30 :UInt32;
  unused31 @31 :AnyPointer;
  unused32 @32 :UInt64;
  gpuUsagePercent @33 :Int8;
  cpuUsagePercent @34 :List(Int8);
  unused35 @35 :AnyPointer;
  unused36 @36 :AnyPointer;
  unused37 @37 :UInt8;
  unused38 @38 :AnyPointer;
  unused39 @39 :AnyPointer;
  powerDrawW @40 :Float32;
  unused41 @41 :Bool;
  somPowerDrawW @42 :Float32;
  unused43 @43 :AnyPointer;
  maxTempC @44 :Float32;
  deviceType @45 :InitData.DeviceType;
  enum ThermalStatus {
    green @0;
    yellow @1;
    red @2;
    danger @3;
  }

}

struct LiveCalibrationData {
  unused0 @0 :AnyPointer;
  unused1 @1 :UInt8;
  calCycle @2 :Int32;
  calPerc @3 :Int8;
  extrinsicMatrix @4 :List(Float32);
  unused5 @5 :AnyPointer;
  unused6 @6 :AnyPointer;
  rpyCalib @7 :List(Float32);
  rpyCalibSpread @8 :List(Float32);
  validBlocks @9 :Int32;
  wideFromDeviceEuler @10 :List(Float32);
  calStatus @11 :Status;
  height @12 :List(Float32);
  enum Status {
    uncalibrated @0;
    calibrated @1;
    invalid @2;
    recalibrating @3;
  }

}

struct DriverMonitoringState {
  unused0 @0 :AnyPointer;
  faceDetected @1 :Bool;
  isDistracted @2 :Bool;
  awarenessStatus @3 :Float32;
  isRHD @4 :Bool;
  unused5 @5 :Bool;
  posePitchOffset @6 :Float32;
  posePitchValidCount @7 :UInt32;
  poseYawOffset @8 :Float32;
  poseYawValidCount @9 :UInt32;
  stepChange @10 :Float32;
  awarenessActive @11 :Float32;
  awarenessPassive @12 :Float32;
  isLowStd @13 :Bool;
  hiStdCount @14 :UInt32;
  unused15 @15 :Bool;
  isActiveMode @16 :Bool;
  distractedType @17 :UInt32;
  unused18 @18 :AnyPointer;
  uncertainCount @19 :UInt32;
}

# openpilot after PR #37799 (April 2026) sends the driverMonitoringState service as this struct at Event @151 (upstream
# names the member driverMonitoringState and renames @71 driverMonitoringStateDEPRECATED; both names are taken by 0.11
# here, so messaging maps this member to its service). modeld reads isRHD only.
struct DriverMonitoringStateV2 {
  unused0 @0 :Bool;
  unused1 @1 :Int8;
  unused2 @2 :Int8;
  unused3 @3 :Bool;
  unused4 @4 :Bool;
  unused5 @5 :UInt16;
  unused6 @6 :UInt16;
  isRHD @7 :Bool;
}

# The driver monitoring model's output (dmonitoringmodeld), one per driver camera frame; dmonitoringd reads it.
struct DriverStateV2 {
  frameId @0 :UInt32;
  modelExecutionTime @1 :Float32;
  unused2 @2 :Float32;
  rawPredictions @3 :Data;
  unused4 @4 :Float32;
  wheelOnRightProb @5 :Float32;
  leftDriverData @6 :DriverData;
  rightDriverData @7 :DriverData;
  gpuExecutionTime @8 :Float32;
  struct DriverData {
    faceOrientation @0 :List(Float32);
    faceOrientationStd @1 :List(Float32);
    facePosition @2 :List(Float32);
    facePositionStd @3 :List(Float32);
    faceProb @4 :Float32;
    leftEyeProb @5 :Float32;
    rightEyeProb @6 :Float32;
    leftBlinkProb @7 :Float32;
    rightBlinkProb @8 :Float32;
    sunglassesProb @9 :Float32;
    occludedProb @10 :Float32;
    readyProb @11 :List(Float32);
    notReadyProb @12 :List(Float32);
    phoneProb @13 :Float32;
    # Named as dmonitoringmodeld fills it since openpilot PR #38049 (May 2026). The stored master reference predates
    # that and calls this same Float32 slot eyesVisibleProb (the 0.11 set has no @14), so the bytes are unchanged.
    sleepProb @14 :Float32;
    eyesClosedProb @15 :Float32;
  }

}

struct LiveDelayData {
  lateralDelay @0 :Float32;
  validBlocks @1 :Int32;
  status @2 :Status;
  lateralDelayEstimate @3 :Float32;
  points @4 :List(Float32);
  lateralDelayEstimateStd @5 :Float32;
  calPerc @6 :Int8;
  enum Status {
    unestimated @0;
    estimated @1;
    invalid @2;
  }

}

struct CameraOdometry {
  trans @0 :List(Float32);
  rot @1 :List(Float32);
  transStd @2 :List(Float32);
  rotStd @3 :List(Float32);
  frameId @4 :UInt32;
  timestampEof @5 :UInt64;
  wideFromDeviceEuler @6 :List(Float32);
  wideFromDeviceEulerStd @7 :List(Float32);
  roadTransformTrans @8 :List(Float32);
  roadTransformTransStd @9 :List(Float32);
}

struct XYZTData {
  x @0 :List(Float32);
  y @1 :List(Float32);
  z @2 :List(Float32);
  t @3 :List(Float32);
  xStd @4 :List(Float32);
  yStd @5 :List(Float32);
  zStd @6 :List(Float32);
}

struct ModelDataV2 {
  frameId @0 :UInt32;
  frameAge @1 :UInt32;
  frameDropPerc @2 :Float32;
  timestampEof @3 :UInt64;
  position @4 :XYZTData;
  orientation @5 :XYZTData;
  velocity @6 :XYZTData;
  orientationRate @7 :XYZTData;
  laneLines @8 :List(XYZTData);
  laneLineProbs @9 :List(Float32);
  roadEdges @10 :List(XYZTData);
  leads @11 :List(LeadDataV2);
  meta @12 :MetaData;
  laneLineStds @13 :List(Float32);
  roadEdgeStds @14 :List(Float32);
  modelExecutionTime @15 :Float32;
  rawPredictions @16 :Data;
  unused17 @17 :UInt32;
  leadsV3 @18 :List(LeadDataV3);
  acceleration @19 :XYZTData;
  frameIdExtra @20 :UInt32;
  unused21 @21 :AnyPointer;
  unused22 @22 :Bool;
  confidence @23 :ConfidenceClass;
  unused24 @24 :UInt64;
  unused25 @25 :AnyPointer;
  action @26 :ModelDataV2.Action;
  # openpilot master (PR #38555, 2026-08): whether the big (Chestnut eGPU) model drove this frame; false on the comma GPU.
  # The ordinal is the next free one, unconfirmed (master's log.capnp was not readable here); a false Bool is no bytes
  # on the wire, so what we send reads the same whatever master's ordinal is.
  big @27 :Bool;
  struct Action {
    desiredCurvature @0 :Float32;
    desiredAcceleration @1 :Float32;
    shouldStop @2 :Bool;
  }

  struct MetaData {
    engagedProb @0 :Float32;
    desirePrediction @1 :List(Float32);
    unused2 @2 :UInt32;
    unused3 @3 :UInt32;
    unused4 @4 :UInt32;
    desireState @5 :List(Float32);
    disengagePredictions @6 :DisengagePredictions;
    hardBrakePredicted @7 :Bool;
    laneChangeState @8 :LaneChangeState;
    laneChangeDirection @9 :LaneChangeDirection;
  }

  struct DisengagePredictions {
    t @0 :List(Float32);
    brakeDisengageProbs @1 :List(Float32);
    gasDisengageProbs @2 :List(Float32);
    steerOverrideProbs @3 :List(Float32);
    brake3MetersPerSecondSquaredProbs @4 :List(Float32);
    brake4MetersPerSecondSquaredProbs @5 :List(Float32);
    brake5MetersPerSecondSquaredProbs @6 :List(Float32);
    gasPressProbs @7 :List(Float32);
    brakePressProbs @8 :List(Float32);
  }

  struct LeadDataV2 {
    prob @0 :Float32;
    t @1 :Float32;
    xyva @2 :List(Float32);
    xyvaStd @3 :List(Float32);
  }

  struct LeadDataV3 {
    prob @0 :Float32;
    probTime @1 :Float32;
    t @2 :List(Float32);
    x @3 :List(Float32);
    xStd @4 :List(Float32);
    y @5 :List(Float32);
    yStd @6 :List(Float32);
    v @7 :List(Float32);
    vStd @8 :List(Float32);
    a @9 :List(Float32);
    aStd @10 :List(Float32);
  }

  enum ConfidenceClass {
    red @0;
    yellow @1;
    green @2;
  }

}

struct DrivingModelData {
  frameId @0 :UInt32;
  frameIdExtra @1 :UInt32;
  action @2 :ModelDataV2.Action;
  laneLineMeta @3 :LaneLineMeta;
  meta @4 :MetaData;
  path @5 :PolyPath;
  frameDropPerc @6 :Float32;
  modelExecutionTime @7 :Float32;
  # openpilot master (PR #38747, 2026-09): as modelV2.big; the next free ordinal, unconfirmed (see modelV2.big)
  big @8 :Bool;
  struct PolyPath {
    xCoefficients @0 :List(Float32);
    yCoefficients @1 :List(Float32);
    zCoefficients @2 :List(Float32);
  }

  struct LaneLineMeta {
    leftY @0 :Float32;
    rightY @1 :Float32;
    leftProb @2 :Float32;
    rightProb @3 :Float32;
  }

  struct MetaData {
    laneChangeState @0 :LaneChangeState;
    laneChangeDirection @1 :LaneChangeDirection;
  }

}

enum LaneChangeState {
  off @0;
  preLaneChange @1;
  laneChangeStarting @2;
  laneChangeFinishing @3;
}

enum LaneChangeDirection {
  none @0;
  left @1;
  right @2;
}

enum Desire {
  none @0;
  turnLeft @1;
  turnRight @2;
  laneChangeLeft @3;
  laneChangeRight @4;
  keepLeft @5;
  keepRight @6;
}
