#!/usr/bin/env bash
# The car's install, proven on an aarch64 userland (issue 29): an arm64 Debian root (debootstrap) run under qemu-user
# (binfmt_misc), the base install of this checkout from aarch64 wheels, then what the car runs: doctor, verify of a QCOM
# bundle, the QCOM artifact loaded and stepped on the emulated render node at level A (submission only), and the smoke of
# an x86_64-built CPU bundle, which must be refused with one line (its programs are the build box's machine code).
# Bundles are built off the car first, here, as the release build does. Then an aarch64 build box: a second venv with the
# [build] extra (onnx, onnxruntime; tinymesa is x86_64-only, so a QCOM compile there is refused with one line) releases a
# CPU bundle of aarch64 machine code, and the car's install smokes it. Level B (executing IR3 on the emulated a630) needs
# Mesa's decoder from tinymesa, so it is x86_64-only too; the car has the real GPU.
#
#   sudo testing/aarch64_car.sh [WORKDIR]     # default /tmp/modeld-aarch64; minutes (the root is reused on a second run)
#
# Needs root (debootstrap, chroot, binfmt_misc), network (Debian arm64 packages, PyPI), and Debian's qemu-user-static
# and debootstrap (installed here when missing). CI does not run it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${1:-/tmp/modeld-aarch64}
ROOT=$WORK/root
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
mkdir -p "$WORK"
t0=$(date +%s)
step() { echo "[aarch64 $(( $(date +%s) - t0 ))s] $*" >&2; }
in_root() { chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/venv/bin:/usr/bin:/bin LANG=C.UTF-8 "$@"; }

CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
step "host: $CPU; $(nproc) cores; $(uname -m)"

# ---- emulation ---------------------------------------------------------------------------------------------------
if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
  step "installing qemu-user-static and debootstrap (Debian packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap >&2
fi
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  # Debian's entry, with F: the interpreter is opened now, so it also runs inside the chroot
  cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
fi

# ---- the arm64 root ----------------------------------------------------------------------------------------------
if [ ! -x "$ROOT/usr/bin/python3" ]; then
  step "debootstrap $SUITE arm64 (python3, venv, clang for the CPU device)"
  rm -rf "$ROOT"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates,clang "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
fi
step "root: $(in_root uname -m), $(in_root python3 --version)"
for d in proc dev; do mountpoint -q "$ROOT/$d" || mount --bind "/$d" "$ROOT/$d"; done
trap 'umount "$ROOT/proc" "$ROOT/dev" 2>/dev/null || true' EXIT
mkdir -p "$ROOT/dev/shm"

# ---- off the car: the bundles ------------------------------------------------------------------------------------
./dev --help >/dev/null 2>&1 || true   # installs the host venv on a fresh clone
if [ ! -f "$WORK/qcom/bundle.json" ] || [ ! -f "$WORK/cpu/bundle.json" ]; then
  step "off the car: tiny models, QCOM and CPU bundles for 1928x1208"
  ./dev models --size tiny -o "$WORK/models" >&2
  ./dev release --vision "$WORK/models/driving_vision.onnx" --policy "$WORK/models/driving_policy.onnx" --device QCOM --camera 1928x1208 -o "$WORK/qcom" >&2
  ./dev release --vision "$WORK/models/driving_vision.onnx" --policy "$WORK/models/driving_policy.onnx" --device CPU --camera 1928x1208 -o "$WORK/cpu" >&2
fi
rm -rf "$ROOT/src" "$ROOT/bundles" && mkdir -p "$ROOT/bundles"
rev=$(git stash create)   # this checkout as it is, edits included
git archive --format=tar --prefix=src/ "${rev:-HEAD}" | tar -x -C "$ROOT"
cp -r "$WORK/qcom" "$WORK/cpu" "$ROOT/bundles/"

# ---- on the car: the base install --------------------------------------------------------------------------------
if [ -f /etc/pip.conf ]; then   # this host's pip settings (an index or a proxy's certificate) hold in the root too
  cp /etc/pip.conf "$ROOT/etc/pip.conf"
  cert=$(sed -n 's/^cert *= *//p' /etc/pip.conf)
  if [ -n "$cert" ] && [ -f "$cert" ]; then mkdir -p "$ROOT$(dirname "$cert")" && cp "$cert" "$ROOT$cert"; fi
fi
step "pip install /src (the base install, aarch64 wheels)"
ti=$(date +%s)
rm -rf "$ROOT/venv"
in_root python3 -m venv /venv
in_root /venv/bin/pip install -q --disable-pip-version-check /src >&2
install_s=$(( $(date +%s) - ti ))
size=$(du -sm "$ROOT/venv" | cut -f1)
step "installed in ${install_s}s, venv ${size} MB: $(in_root /venv/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(tinygrad|numpy|pycapnp|cryptography|tinymesa|onnx|av|ray)=' | tr '\n' ' ')"
if in_root /venv/bin/python -c "import tinymesa" 2>/dev/null; then echo "tinymesa is installed: not the car's base install" >&2; exit 1; fi

run() { local ts; ts=$(date +%s); step "$*"; in_root "$@" >&2; step "  ok in $(( $(date +%s) - ts ))s"; }
run modeld-msm doctor --emu --rounds 2
art=$(in_root sh -c 'ls -d /bundles/qcom/*/ | head -1')
run modeld-msm verify "$art"
run env MODELD_DEV=EMU+QCOM:IR3 python -c "
import numpy as np
from artifact.format import verify_artifact
from modeld_msm.core import ModeldCore
from modeld_msm.frames import Frame
from selfdrive_glue.nv12 import nv12_info
core = ModeldCore(verify_artifact('$art'))
buf = np.zeros(nv12_info(*core.camera).size, np.uint8)
steps = [len(core.on_frame(Frame(buf, n, n * 50_000_000, n * 50_000_000 + 1))) for n in range(1, 6)]
assert steps == [3] * 5, steps
print('QCOM artifact on the emulated node, level A: 5 steps published', core.stats.published)"
step "smoke of the x86_64 CPU bundle: refused with one line, not run (its programs are the build box's code)"
ts=$(date +%s)
rc=0; in_root modeld-msm smoke --bundle /bundles/cpu >"$WORK/smoke.log" 2>&1 || rc=$?
tail -3 "$WORK/smoke.log" >&2
if [ "$rc" -ne 2 ] || ! grep -q "holds x86_64 machine code" "$WORK/smoke.log"; then step "  expected a one-line refusal (exit 2), got exit $rc"; exit 1; fi
step "  refused as it should be, in $(( $(date +%s) - ts ))s"

# ---- an aarch64 build box: the CPU bundle compiled here, smoked by the car's install --------------------------------
step "build venv: /src[build] from aarch64 wheels (onnx, onnxruntime; no tinymesa there)"
ti=$(date +%s)
rm -rf "$ROOT/venv-build" "$ROOT/models" "$ROOT/bundles/cpu-aarch64"
in_root python3 -m venv /venv-build
in_root /venv-build/bin/pip install -q --disable-pip-version-check '/src[build]' >&2
build_install_s=$(( $(date +%s) - ti ))
step "  build venv in ${build_install_s}s, $(du -sm "$ROOT/venv-build" | cut -f1) MB"
ts=$(date +%s)
in_root /venv-build/bin/modeld-msm models --size tiny -o /models >&2
rc=0; in_root /venv-build/bin/modeld-msm compile --vision /models/driving_vision.onnx --policy /models/driving_policy.onnx --device QCOM -o /tmp/q >"$WORK/qcom_refused.log" 2>&1 || rc=$?
step "  QCOM compile on aarch64: exit $rc: $(tail -1 "$WORK/qcom_refused.log")"
if [ "$rc" -ne 2 ] || [ -e "$ROOT/tmp/q" ]; then step "  expected a one-line refusal (exit 2) and nothing written"; exit 1; fi
in_root /venv-build/bin/modeld-msm release --vision /models/driving_vision.onnx --policy /models/driving_policy.onnx --device CPU --camera 1928x1208 -o /bundles/cpu-aarch64 >&2
release_s=$(( $(date +%s) - ts ))
step "  CPU bundle released on aarch64 (tiny models, all compile checks) in ${release_s}s"
run modeld-msm smoke --bundle /bundles/cpu-aarch64
step "done: install ${install_s}s, ${size} MB; build venv ${build_install_s}s; aarch64 CPU release ${release_s}s"
