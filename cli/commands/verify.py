"""`modeld-msm verify DIR`: integrity, versions and device of an artifact, without unpickling it."""
from __future__ import annotations

from pathlib import Path

from artifact.format import DEVICES, MANIFEST, verify_artifact
from release.bundle import BUNDLE_FILE, verify_bundle
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera


def add_arguments(p) -> None:
  p.add_argument("artifact", help="artifact directory written by `modeld-msm compile`, or a release bundle (every artifact and smoke file)")
  p.add_argument("--device", help="require this device (CPU or QCOM)")
  p.add_argument("--camera", help="require this camera size, e.g. 1928x1208")
  p.add_argument("--pubkey", help="require a valid signature by this public key (default: $MODELD_PUBKEY, if set)")


def run(args) -> int:
  if args.device is not None and args.device not in DEVICES:
    raise UserError(f"unknown device '{args.device}': use one of {', '.join(DEVICES)}")
  if not (Path(args.artifact) / MANIFEST).exists() and (Path(args.artifact) / BUNDLE_FILE).exists():
    return _verify_bundle(args)
  art = verify_artifact(args.artifact, device=args.device, camera=parse_camera(args.camera) if args.camera else None,
                        pubkey=args.pubkey)
  m = art.meta
  print(f"{art.path}: OK")
  print(f"  kind     {art.kind}: the {art.spec.title}, {art.spec.contract}" + ("" if "programs" in m else " (programs not recorded: built "
                                                                                       "before they were, its kind's assumed)"))
  for file, prog in art.programs.items():
    outs = ", ".join(o["name"] for o in prog["outputs"]) or "its state only"
    print(f"  program  {file} ({prog['role']}): {', '.join(i['name'] for i in prog['inputs'])} -> {outs}")
    for i in (i for i in prog["inputs"] if i.get("members")):   # a packed input: its layout, as the runtime fills it
      print(f"  packed   {i['name']} ({i['shape'][0]} bytes, one upload): " + ", ".join(f"{x['name']} @{x['offset']}" for x in i["members"]))
  print(f"  camera   {art.camera[0]}x{art.camera[1]}  device {m['device']}  load target {m['load_target']}")
  print(f"  renderer {m['renderer']}  arch {m['arch']}  host {m['host']}")
  if prec := m.get("precision"):
    print(f"  compute  {prec['compute']} ({prec['why']})")
  print("  versions " + "  ".join(f"{k} {v}" for k, v in m["versions"].items()))
  for kind, mm in m["models"].items():
    print(f"  {kind:7s} {mm['file']}  sha256 {mm['sha256'][:16]}…  out {mm['output_shapes']}")
  print(f"  files    {len(art.digests)} checked against the manifest; " +
        (f"signed by key {art.signed_by}" if art.signed_by else "signature not checked (no public key configured)"))
  return 0


def _verify_bundle(args) -> int:
  """A release bundle: each listed artifact and each recorded smoke test, as install and smoke check them."""
  b = verify_bundle(args.artifact, device=args.device, cameras=[args.camera] if args.camera else None, pubkey=args.pubkey, smoke=None)
  for kind, arts in (("driving", b.artifacts), ("driver monitoring", b.dm_artifacts)):
    for cam, art in arts.items():
      print(f"{art.path}: OK  ({kind}, {cam}, {art.target}" + (f", signed by key {art.signed_by})" if art.signed_by else ")"))
  checked = any(a.signed_by for a in b.artifacts.values())
  print(f"{b.path}: OK, a {b.device} bundle of {len(b.artifacts) + len(b.dm_artifacts)} artifact(s)"
        + ("" if checked else "; signatures not checked (no public key configured)"))
  return 0
