# modeld-msm's own cereal schema: the subset of openpilot 0.11's messages that modeld reads and writes.
# Wire-compatible with openpilot: every field keeps openpilot's ordinal and type size, and each ordinal we do not
# use is held by an `unusedN` placeholder (or an AnyPointer union member under openpilot's name) of the same size,
# so field offsets and union discriminants are identical. Structs stop after the last ordinal we need; later
# upstream fields are simply ignored. File and struct ids differ from openpilot's on purpose, so both schemas can be
# loaded into one process (tests compare them). tests/test_schema_compat.py checks the layout against the reference.

@0xcef05d8ff7c46ae0;

struct CarState {
  unused0 @0 :AnyPointer;
  vEgo @1 :Float32;
  unused2 @2 :AnyPointer;
  unused3 @3 :UInt32;
  gasPressed @4 :Bool;
  brake @5 :Float32;
  brakePressed @6 :Bool;
  steeringAngleDeg @7 :Float32;
  steeringTorque @8 :Float32;
  steeringPressed @9 :Bool;
  unused10 @10 :AnyPointer;
  unused11 @11 :AnyPointer;
  unused12 @12 :AnyPointer;
  unused13 @13 :AnyPointer;
  gearShifter @14 :GearShifter;
  steeringRateDeg @15 :Float32;
  aEgo @16 :Float32;
  vEgoRaw @17 :Float32;
  standstill @18 :Bool;
  unused19 @19 :Bool;
  leftBlinker @20 :Bool;
  rightBlinker @21 :Bool;
  yawRate @22 :Float32;
  unused23 @23 :Bool;
  unused24 @24 :Bool;
  unused25 @25 :Bool;
  canValid @26 :Bool;
  unused27 @27 :Float32;
  unused28 @28 :Bool;
  unused29 @29 :Bool;
  unused30 @30 :Bool;
  unused31 @31 :Bool;
  unused32 @32 :Bool;
  leftBlindspot @33 :Bool;
  rightBlindspot @34 :Bool;
  enum GearShifter {
    unknown @0;
    park @1;
    drive @2;
    neutral @3;
    reverse @4;
    sport @5;
    low @6;
    brake @7;
    eco @8;
    manumatic @9;
  }

}

struct CarControl {
  enabled @0 :Bool;
  unused1 @1 :UInt32;
  unused2 @2 :UInt32;
  unused3 @3 :UInt32;
  unused4 @4 :AnyPointer;
  unused5 @5 :AnyPointer;
  unused6 @6 :AnyPointer;
  unused7 @7 :Bool;
  unused8 @8 :UInt32;
  unused9 @9 :UInt32;
  unused10 @10 :AnyPointer;
  latActive @11 :Bool;
  longActive @12 :Bool;
  orientationNED @13 :List(Float32);
  angularVelocity @14 :List(Float32);
  leftBlinker @15 :Bool;
  rightBlinker @16 :Bool;
  currentCurvature @17 :Float32;
}

struct CarParams {
  brand @0 :Text;
  carFingerprint @1 :Text;
  unused2 @2 :Bool;
  pcmCruise @3 :Bool;
  unused4 @4 :Bool;
  unused5 @5 :Bool;
  unused6 @6 :Bool;
  minEnableSpeed @7 :Float32;
  minSteerSpeed @8 :Float32;
  unused9 @9 :UInt16;
  unused10 @10 :UInt16;
  unused11 @11 :AnyPointer;
  unused12 @12 :AnyPointer;
  unused13 @13 :AnyPointer;
  unused14 @14 :AnyPointer;
  unused15 @15 :AnyPointer;
  unused16 @16 :AnyPointer;
  mass @17 :Float32;
  wheelbase @18 :Float32;
  centerToFront @19 :Float32;
  steerRatio @20 :Float32;
  steerRatioRear @21 :Float32;
  rotationalInertia @22 :Float32;
  tireStiffnessFront @23 :Float32;
  tireStiffnessRear @24 :Float32;
  unused25 @25 :AnyPointer;
  lateralTuning :union {
    unused26 @26 :AnyPointer;
    unused27 @27 :AnyPointer;
    unused40 @40 :AnyPointer;
    unused67 @67 :AnyPointer;
  }
  steerLimitAlert @28 :Bool;
  vEgoStopping @29 :Float32;
  unused30 @30 :Bool;
  unused31 @31 :Bool;
  startAccel @32 :Float32;
  unused33 @33 :UInt32;
  unused34 @34 :UInt16;
  radarUnavailable @35 :Bool;
  steerActuatorDelay @36 :Float32;
  openpilotLongitudinalControl @37 :Bool;
  carVin @38 :Text;
  unused39 @39 :Bool;
  dashcamOnly @41 :Bool;
  unused42 @42 :UInt16;
  unused43 @43 :UInt16;
  unused44 @44 :AnyPointer;
  unused45 @45 :UInt32;
  unused46 @46 :Bool;
  steerLimitTimer @47 :Float32;
  unused48 @48 :AnyPointer;
  unused49 @49 :UInt16;
  unused50 @50 :UInt16;
  unused51 @51 :UInt32;
  stoppingDecelRate @52 :Float32;
  unused53 @53 :UInt32;
  unused54 @54 :UInt32;
  fuzzyFingerprint @55 :Bool;
  enableBsm @56 :Bool;
  unused57 @57 :Bool;
  longitudinalActuatorDelay @58 :Float32;
  vEgoStarting @59 :Float32;
  stopAccel @60 :Float32;
  unused61 @61 :UInt32;
  unused62 @62 :AnyPointer;
  wheelSpeedFactor @63 :Float32;
  flags @64 :UInt32;
  alternativeExperience @65 :Int16;
  notCar @66 :Bool;
  maxLateralAccel @68 :Float32;
  autoResumeSng @69 :Bool;
  startingState @70 :Bool;
  alphaLongitudinalAvailable @71 :Bool;
  tireStiffnessFactor @72 :Float32;
  passive @73 :Bool;
  radarDelay @74 :Float32;
  secOcRequired @75 :Bool;
  secOcKeyAvailable @76 :Bool;
  steerAtStandstill @77 :Bool;
}
