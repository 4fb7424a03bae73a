"""tinygrad's own backend suites on the emulated a630: every kernel of every test compiled by Mesa's IR3 compiler (tinymesa)
and executed by our interpreter over the emulated render node (DEV=EMU+QCOM:IR3, EMU_EXEC=1, faults fatal).

  python testing/tinygrad_suites.py --tinygrad-src ~/src/tinygrad [--suites test_ops,test_dtype] [--extra-path DIR] [--json F]

CI cannot fetch tinygrad's source, so this is a bench: point it at a checkout (`git clone https://github.com/tinygrad/tinygrad`,
as near 0.14.0 as you can: the script says how far the checkout's tinygrad/ is from the installed one). Only the checkout's
test/ tree is used, copied into a temporary folder, so the tinygrad that runs is the pinned 0.14.0 of this install. The
tests need torch and hypothesis, which this project does not install (`pip install --target DIR hypothesis torch --index-url
https://download.pytorch.org/whl/cpu`, then `--extra-path DIR`).

Each failure is looked up in testing/tinygrad_verdicts.json (a test pattern -> what it is: an emulator error, tinygrad's IR3
renderer, a hardware bound, or the test's own host assumption, each with its evidence); one without a verdict is counted
unexplained. Prints a table per suite (passed/skipped/failed, explained/unexplained, the a630 work executed) and the failures.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERDICTS = REPO / "testing" / "tinygrad_verdicts.json"
# image convolutions and matmuls: what IMAGE=1/2 changes (upstream's test_image_dtype was removed in #15574; test_ops holds
# the image cases now)
IMAGE_K = "conv or matmul or gemm or dot or linear or pool or einsum"
# name -> (file under test/, extra env, -k expression)
SUITES: dict[str, tuple[str, dict[str, str], str]] = {
  "test_ops": ("backend/test_ops.py", {}, ""),
  "test_ops IMAGE=1": ("backend/test_ops.py", {"IMAGE": "1"}, IMAGE_K),
  "test_ops IMAGE=2": ("backend/test_ops.py", {"IMAGE": "2"}, IMAGE_K),
  "test_dtype": ("backend/test_dtype.py", {}, ""),
  "test_dtype_alu": ("backend/test_dtype_alu.py", {}, ""),
  "test_jit": ("backend/test_jit.py", {}, ""),
  "test_uops": ("backend/test_uops.py", {}, ""),
  "test_linearizer": ("backend/test_linearizer.py", {}, ""),
  "test_graph": ("backend/test_graph.py", {}, ""),
  "test_transcendental": ("backend/test_transcendental.py", {}, ""),
  "test_const_folding": ("backend/test_const_folding.py", {}, ""),
  "test_setitem": ("backend/test_setitem.py", {}, ""),
}
DEFAULT_SUITES = ("test_ops", "test_dtype", "test_dtype_alu", "test_jit", "test_uops", "test_linearizer", "test_graph",
                  "test_ops IMAGE=1", "test_ops IMAGE=2")


@dataclass
class Case:
  test: str        # file::Class::name
  outcome: str     # passed / skipped / failed
  message: str = ""
  seconds: float = 0.0


@dataclass
class SuiteResult:
  name: str
  cases: list[Case] = field(default_factory=list)
  seconds: float = 0.0
  stats: dict = field(default_factory=dict)
  error: str = ""

  def count(self, outcome: str) -> int:
    return sum(c.outcome == outcome for c in self.cases)


def read_junit(path: Path) -> list[Case]:
  cases = []
  for tc in ET.parse(path).getroot().iter("testcase"):
    file = (tc.get("classname") or "").replace(".", "/")
    cls, _, _ = file.rpartition("/")
    test = f"{cls}.py::{file.rsplit('/', 1)[-1]}::{tc.get('name')}" if cls else f"{file}::{tc.get('name')}"
    outcome, message = "passed", ""
    for child in tc:
      if child.tag in ("failure", "error"):
        outcome, message = "failed", (child.get("message") or child.text or "").strip()
      elif child.tag == "skipped" and outcome == "passed":
        outcome, message = "skipped", (child.get("message") or "").strip()
    cases.append(Case(test, outcome, message.splitlines()[0][:300] if message else "", float(tc.get("time") or 0)))
  return cases


def load_verdicts(path: Path) -> list[dict]:
  data = json.loads(path.read_text()) if path.exists() else {"verdicts": []}
  return data["verdicts"]


def verdict_for(suite: str, case: Case, verdicts: list[dict]) -> dict | None:
  for v in verdicts:
    if fnmatch.fnmatchcase(case.test, v["test"]) and fnmatch.fnmatchcase(suite, v.get("suite", "*")):
      return v
  return None


def installed_distance(src: Path) -> str:
  """How far the checkout's tinygrad/ is from the installed package: the tests are written against the former."""
  import tinygrad
  inst = Path(tinygrad.__file__).parent
  ours = {p.relative_to(inst) for p in inst.rglob("*.py")}
  theirs = {p.relative_to(src / "tinygrad") for p in (src / "tinygrad").rglob("*.py")}
  differ = sum((inst / p).read_bytes() != (src / "tinygrad" / p).read_bytes() for p in ours & theirs)
  rev = subprocess.run(["git", "-C", str(src), "log", "-1", "--format=%h %ad %s", "--date=short"], capture_output=True, text=True)
  head = rev.stdout.strip() or "not a git checkout"
  return (f"checkout {head}; its tinygrad/ against the installed tinygrad {installed_version()}: {differ} of {len(ours & theirs)} "
          f"common files differ, {len(theirs - ours)} only in the checkout, {len(ours - theirs)} only installed")


def installed_version() -> str:
  return importlib.metadata.version("tinygrad")


def run_suite(name: str, tests: Path, env: dict[str, str], args) -> SuiteResult:
  file, extra_env, k = SUITES[name]
  res = SuiteResult(name)
  with tempfile.TemporaryDirectory(prefix="tg_suite_") as td:
    xml, stats = Path(td) / "junit.xml", Path(td) / "stats.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "tinygrad_emu_plugin", "-p", "no:cacheprovider", "-q", f"test/{file}",
           f"--junitxml={xml}", f"--timeout={args.timeout}", "-o", "junit_family=xunit1"]
    if k:
      cmd += ["-k", k]
    if args.jobs > 1:
      cmd += ["-n", str(args.jobs)]
    run_env = {**env, **extra_env, "TG_SUITE_STATS": str(stats)}
    t0 = time.perf_counter()
    log = Path(args.logs) / f"{name.replace(' ', '_').replace('=', '')}.log"
    with open(log, "w") as f:
      p = subprocess.Popen(cmd, cwd=tests, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      assert p.stdout is not None
      for line in p.stdout:   # pytest's own progress ([ 42%]) is the progress bar
        f.write(line)
        if line.rstrip().endswith("%]"):
          print(f"  {name}: {line.strip()[-7:]}  {time.perf_counter() - t0:6.0f} s", file=sys.stderr, flush=True)
      p.wait()
    res.seconds = time.perf_counter() - t0
    if xml.exists():
      res.cases = read_junit(xml)
    if stats.exists() and not args.jobs > 1:
      res.stats = json.loads(stats.read_text())
    if p.returncode not in (0, 1):
      res.error = f"pytest exit {p.returncode}: see {log}"
  return res


def report(results: list[SuiteResult], verdicts: list[dict], json_out: Path | None) -> int:
  """The table and the failures with their verdicts (and every case to json_out); -> the number of unexplained failures."""
  rows, failures = [], []
  for r in results:
    fails = [c for c in r.cases if c.outcome == "failed"]
    judged = [(c, verdict_for(r.name, c, verdicts)) for c in fails]
    failures += [(r.name, c, v) for c, v in judged]
    st = r.stats
    rows.append((r.name, r.count("passed"), r.count("skipped"), len(fails), sum(v is not None for _, v in judged),
                 sum(v is None for _, v in judged), r.seconds, st.get("dispatches", "-"),
                 f"{st['fiber_instrs'] / 1e6:.0f} M" if st else "-", r.error))
  print(f"\n{'suite':20s} {'passed':>7s} {'skipped':>8s} {'failed':>7s} {'explained':>10s} {'unexplained':>12s} {'time s':>7s} "
        f"{'dispatches':>11s} {'fiber-instr':>12s}")
  for n, p, s, f, e, u, t, d, fi, err in rows:
    print(f"{n:20s} {p:7d} {s:8d} {f:7d} {e:10d} {u:12d} {t:7.0f} {d!s:>11s} {fi:>12s} {err}")
  tot = [sum(r[i] for r in rows) for i in range(1, 6)]
  print(f"{'all':20s} {tot[0]:7d} {tot[1]:8d} {tot[2]:7d} {tot[3]:10d} {tot[4]:12d}")
  if failures:
    print("\nfailures:")
    for suite, c, v in failures:
      what = f"{v['verdict']}: {v['why']}" if v else "UNEXPLAINED: " + c.message
      print(f"  [{suite}] {c.test}\n      {what}")
  if json_out:
    json_out.write_text(json.dumps([{"suite": r.name, "seconds": r.seconds, "stats": r.stats, "error": r.error,
                                      "cases": [asdict(c) | {"verdict": (verdict_for(r.name, c, verdicts) or {}).get("verdict")}
                                                for c in r.cases]} for r in results], indent=1))
  return tot[4]


def results_from_json(path: Path) -> list[SuiteResult]:
  """A run written by --json, to be judged again against the verdicts as they are now."""
  out = []
  for r in json.loads(path.read_text()):
    cases = [Case(c["test"], c["outcome"], c.get("message", ""), c.get("seconds", 0.0)) for c in r["cases"]]
    out.append(SuiteResult(r["suite"], cases, r["seconds"], r.get("stats", {}), r.get("error", "")))
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tinygrad-src", type=Path, help="a checkout of tinygrad's source (its test/ is used)")
  ap.add_argument("--from-json", type=Path, help="judge a run written by --json again (after verdicts were added), without running")
  ap.add_argument("--suites", default=",".join(DEFAULT_SUITES), help=f"comma-separated, of: {', '.join(SUITES)}")
  ap.add_argument("--extra-path", action="append", default=[], help="a folder with torch and hypothesis (repeatable)")
  ap.add_argument("--timeout", type=int, default=600, help="seconds per test (the interpreter is slow on big tensors)")
  ap.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers (the emulator's work counts need 1)")
  ap.add_argument("--verdicts", type=Path, default=VERDICTS)
  ap.add_argument("--logs", default=None, help="folder for each suite's pytest output (default: a temporary one)")
  ap.add_argument("--json", type=Path, help="also write every case and its verdict here")
  args = ap.parse_args(argv)
  if args.from_json:
    results = results_from_json(args.from_json)
    return 1 if report(results, load_verdicts(args.verdicts), args.json) or any(r.error for r in results) else 0
  if args.tinygrad_src is None:
    ap.error("--tinygrad-src is required (or --from-json)")

  names = [s.strip() for s in args.suites.split(",") if s.strip()]
  if bad := [n for n in names if n not in SUITES]:
    ap.error(f"unknown suite(s) {', '.join(bad)}: use {', '.join(SUITES)}")
  src = args.tinygrad_src.expanduser().resolve()
  if not (src / "test" / "backend" / "test_ops.py").is_file() or not (src / "tinygrad").is_dir():
    ap.error(f"{src} is not a tinygrad source checkout (no test/backend/test_ops.py): git clone https://github.com/tinygrad/tinygrad")
  path = os.pathsep.join([*(str(Path(p).resolve()) for p in args.extra_path), str(REPO / "testing"), str(REPO)])
  probe = subprocess.run([sys.executable, "-c", "import torch, hypothesis"], env={**os.environ, "PYTHONPATH": path},
                         capture_output=True, text=True)
  if probe.returncode != 0:
    ap.error("tinygrad's tests need torch and hypothesis: pip install --target DIR hypothesis torch "
             "--index-url https://download.pytorch.org/whl/cpu, then --extra-path DIR")
  verdicts = load_verdicts(args.verdicts)
  args.logs = args.logs or tempfile.mkdtemp(prefix="tg_suite_logs_")
  Path(args.logs).mkdir(parents=True, exist_ok=True)

  sys.path.insert(0, str(REPO))
  from artifact.cpu_info import cpu_info
  print(f"CPU: {cpu_info().summary()}; Python {platform.python_version()}; tinygrad {installed_version()}")
  print(installed_distance(src))
  results = []
  with tempfile.TemporaryDirectory(prefix="tg_tests_") as td:
    tests = Path(td)
    shutil.copytree(src / "test", tests / "test", ignore=shutil.ignore_patterns("__pycache__"))
    # the tests' own package, our repository (backend) and the plugin; never the checkout's tinygrad/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), path]), "DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1",
           "EMU_STRICT_FAULTS": "1", "PYTHONUNBUFFERED": "1"}
    for name in names:
      print(f"[suites] {name} ...", file=sys.stderr, flush=True)
      results.append(r := run_suite(name, tests, env, args))
      print(f"[suites] {name}: {r.count('passed')} passed, {r.count('skipped')} skipped, {r.count('failed')} failed in "
            f"{r.seconds:.0f} s {r.error}", file=sys.stderr, flush=True)

  tot_unexplained = report(results, verdicts, args.json)
  print(f"\npytest output per suite: {args.logs}")
  return 1 if tot_unexplained or any(r.error for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
