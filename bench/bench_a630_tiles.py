#!/usr/bin/env python3
"""What the register-tile lever is worth per frame, by the a630 cost model: one artifact compiled with tinygrad's heuristic
opts and one with the shipped register tiles (compile/tuning/qcom_tiles.py), each frame executed on the emulated node
(level B, bench_a630.frame_of) and costed under the shipped constants and under the constants the lever depends on.

  .venv/bin/python bench/bench_a630_tiles.py --tiled dmonitoring TILED_DIR [--pair driving HEURISTIC_DIR TILED_DIR ...] [--json OUT]

--tiled needs only the tiled artifact: its heuristic frame is the same frame with each register-tile kernel's work
replaced by the work its heuristic kernel executed in the recording (the shipped table keeps every variant's counts;
a convolution's counts do not depend on its data). --pair compiles nothing either but needs both artifacts, and checks
that substitution on the kinds it is given both for.

A tile that fetches fewer texels per multiply-add wins while the texture rate bounds the kernel; it holds more registers,
so it loses where fewer resident waves cannot hide the fetches. So the frame is given at tex_rate half and double and at
hide_waves 1 and 8 (the ends of their ranges, backend/a630_cost.UNSOURCED), and the band of each over every corner.
Heuristic artifacts: `MODELD_QCOM_TILES=off modeld-msm compile ... --device QCOM`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend import a630_cost as ac  # noqa: E402
from bench.bench_a630 import KINDS, frame_of, machine  # noqa: E402

D = ac.DEFAULT
CASES = {
  "shipped": D,
  "tex_rate /2": replace(D, tex_rate=D.tex_rate / 2),
  "tex_rate x2": replace(D, tex_rate=D.tex_rate * 2),
  "hide_waves 1": replace(D, hide_waves=1.0),
  "hide_waves 8": replace(D, hide_waves=8.0),
  "tex /2, hide 8": replace(D, tex_rate=D.tex_rate / 2, hide_waves=8.0),
  "tex x2, hide 8": replace(D, tex_rate=D.tex_rate * 2, hide_waves=8.0),
}


def compare(kind: str, heur: list[ac.Work], tiled: list[ac.Work], top: int = 8) -> dict:
  print(f"\n{kind}: {len(heur)} dispatches (heuristic) vs {len(tiled)} (register tiles)")
  print(f"  {'constants':<16} {'heuristic ms':>12} {'tiles ms':>9} {'change ms':>9} {'change':>7}")
  out: dict = {"dispatches": [len(heur), len(tiled)], "cases": {}}
  for label, c in CASES.items():
    h, t = ac.frame_us(heur, c) / 1e3, ac.frame_us(tiled, c) / 1e3
    out["cases"][label] = {"heuristic_ms": round(h, 3), "tiles_ms": round(t, 3)}
    print(f"  {label:<16} {h:>12.2f} {t:>9.2f} {t - h:>+9.2f} {100 * (t - h) / h:>+6.1f}%")
  hb, tb = ac.band_us(heur), ac.band_us(tiled)
  out["band_ms"] = {"heuristic": [round(x / 1e3, 2) for x in hb], "tiles": [round(x / 1e3, 2) for x in tb]}
  print(f"  band over every unsourced constant: heuristic {hb[0] / 1e3:.2f}-{hb[1] / 1e3:.2f} ms, tiles {tb[0] / 1e3:.2f}-{tb[1] / 1e3:.2f} ms")
  # the kernels that differ, by name (a kernel on other tiles has another name)
  hn, tn = {w.name for w in heur}, {w.name for w in tiled}
  gone = [w for w in heur if w.name not in tn]
  new = [w for w in tiled if w.name not in hn]
  for title, ws in (("heuristic kernels replaced", gone), ("their register-tile kernels", new)):
    print(f"  {title}:")
    for w, us in sorted(zip(ws, ac.dispatch_us(ws)), key=lambda x: -x[1])[:top]:
      print(f"    {w.name[:40]:<40} {us:>8.0f} us  regs {w.regs:>2} ({ac.reg_waves(w.regs):>2} waves/SP)  {w.tex / 1e6:>6.2f} M texels  "
            f"{w.fibers:>7} fibers")
  return out


def heuristic_of(kind: str, tiled: list[ac.Work]) -> list[ac.Work]:
  """The tiled frame with each shipped register-tile kernel's work replaced by its heuristic kernel's, from the table."""
  from compile.tuning.qcom_tiles import load_table
  heur: dict[str, ac.Work] = {}
  for s in load_table()["sets"]:
    if s["match"]["kind"] == kind:
      for e in s["entries"]:
        if e["name"] != e["heuristic"]:
          heur[e["name"]] = ac.Work(**e["variants"][0]["work"])
  if not any(w.name in heur for w in tiled):
    raise SystemExit(f"no kernel of this {kind} artifact is one of the shipped register tiles")
  return [heur.get(w.name, w) for w in tiled]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--pair", nargs=3, action="append", default=[], metavar=("KIND", "HEURISTIC", "TILED"),
                  help="a kind and its two QCOM artifacts (heuristic opts, register tiles)")
  ap.add_argument("--tiled", nargs=2, action="append", default=[], metavar=("KIND", "TILED"),
                  help="a kind and its QCOM artifact compiled with the register tiles")
  ap.add_argument("--json", type=Path)
  a = ap.parse_args()
  print(f"machine: {machine()} (the estimates do not depend on it)")
  print("constants: " + ", ".join(f"{k}={v:.4g}" for k, v in ac.constants_dict(D).items()))
  if not a.pair and not a.tiled:
    ap.error("give --tiled KIND DIR or --pair KIND HEURISTIC TILED")
  out = {}
  for kind, *dirs in a.pair + a.tiled:
    if kind not in KINDS:
      raise SystemExit(f"unknown kind {kind}: one of {', '.join(KINDS)}")
    frames = [[d.work for d in frame_of(Path(p))] for p in dirs]
    if len(frames) == 2:
      heur, tiled = frames
      subst = heuristic_of(kind, tiled)
      print(f"\n{kind}: the tiled frame with the table's heuristic work substituted: {ac.frame_us(subst) / 1e3:.3f} ms, "
            f"the heuristic artifact's frame: {ac.frame_us(heur) / 1e3:.3f} ms")
    else:
      tiled = frames[0]
      heur = heuristic_of(kind, tiled)
    out[kind + (" (two artifacts)" if len(frames) == 2 else "")] = compare(kind, heur, tiled)
  if a.json:
    a.json.write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
