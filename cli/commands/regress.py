"""`modeld-msm regress`: compare two replay output logs field by field."""
from __future__ import annotations

import sys
from pathlib import Path

from offcar.log_compare import DEFAULT_IGNORE
from offcar.regress import check_segments, regress, summary_lines, write_report
from offcar.replay_accuracy import regress_accuracy, regress_lines
from offcar.report import GATES, find_segments
from selfdrive_glue.route import expand_segments


def add_arguments(p) -> None:
  p.add_argument("new", metavar="NEW", help="output log (or output directory) of the run under test")
  p.add_argument("ref", metavar="REF", help="reference output log (or directory)")
  p.add_argument("--report", metavar="DIR",
                 help="write report.html here (pass/fail per field, difference distributions, the worst frames drawn on the camera "
                      "image), with report.txt, report.json and the PNGs it shows")
  p.add_argument("--segment", nargs="+", default=[], metavar="DIR",
                 help="--report: the segments (or route folders) the outputs were replayed from, matched to logs by segment name, for "
                      "the camera images of the worst frames (default: the segment `replay --engine ray` recorded beside each output)")
  p.add_argument("--gate", choices=("openpilot-device", "openpilot-pc"),
                 help="openpilot's model_replay tolerances: openpilot-device = float epsilon; openpilot-pc = 0.3 and the "
                      "trajectory-like outputs (position, leads, lane lines, road edges, path) not compared. "
                      "--tolerance/--abs-tolerance given as well override its numbers")
  p.add_argument("--tolerance", type=float, default=None,
                 help="relative tolerance |a-b| <= X*max(|a|,|b|) (default 0: exact, for the same device and build)")
  p.add_argument("--abs-tolerance", type=float, default=None, help="absolute tolerance, for values near zero (default 0)")
  p.add_argument("--ignore", nargs="+", metavar="FIELD", default=list(DEFAULT_IGNORE),
                 help=f"fields to skip, by name at any depth or dotted prefix (default: {' '.join(DEFAULT_IGNORE)})")
  p.add_argument("--top", type=int, default=10, help="how many of the worst fields to print (default 10)")
  p.add_argument("--allow-different-drives", action="store_true",
                 help="compare NEW and REF (and draw on --segment) even where they are replays of different drives (other synthetic "
                      "seed, camera clock or frames, or no log in common); each mismatch is printed as a WARNING line. Without it "
                      "such a comparison is refused")


def run(args) -> int:
  rel, abs_, ignore = GATES[args.gate] if args.gate else (0.0, 0.0, ())
  args.tolerance = rel if args.tolerance is None else args.tolerance
  args.abs_tolerance = abs_ if args.abs_tolerance is None else args.abs_tolerance
  ignore = tuple(args.ignore) + ignore
  segments = expand_segments(args.segment) if args.segment else []
  results, messages = regress(args.new, args.ref, args.tolerance, args.abs_tolerance, ignore, args.allow_different_drives)
  if segments or args.report:  # the segments the accuracy and the worst frames' pictures come from must be the runs' drive

    check_segments(results, find_segments(sorted(messages), segments, Path(args.new), Path(args.ref)), segments, args.allow_different_drives)
  failed = [r for r in results if r.regression]
  for line in summary_lines(results, args.top):
    print(line)
  # synthetic segments: each run against the road the renderer drew, beside the field comparison (says nothing otherwise)

  accuracy = regress_accuracy(messages, Path(args.new), Path(args.ref), segments)
  for line in regress_lines(accuracy):
    print(line)
  n_msgs = sum(r.messages_new for r in results)
  if args.report:
    paths = write_report(args.report, results, messages, args.tolerance, ignore, args.abs_tolerance, args.new, args.ref, args.gate, segments,
                         accuracy)
    print(f"report: {next(p for p in paths if p.suffix == '.html')} (and {len(paths) - 1} files beside it)")
  if failed:
    print(f"REGRESSION: {len(failed)} of {len(results)} log(s) differ from the reference", file=sys.stderr)
    return 1
  print(f"PASS: {len(results)} log(s), {n_msgs} messages match (tolerance {args.tolerance})")
  return 0
