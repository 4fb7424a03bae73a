"""`modeld-msm regress`: compare two replay output logs field by field."""
from __future__ import annotations

import sys

HELP = "compare two replay output logs field by field"


def add_arguments(p) -> None:
  from modeld_msm.regress import DEFAULT_IGNORE
  p.add_argument("new", metavar="NEW", help="output log (or output directory) of the run under test")
  p.add_argument("ref", metavar="REF", help="reference output log (or directory)")
  p.add_argument("--report", metavar="DIR", help="write report.txt, report.json and PNG plots (plan, lane lines, lead) here")
  p.add_argument("--tolerance", type=float, default=0.0,
                 help="relative tolerance |a-b| <= X*max(|a|,|b|) (default 0: exact, for the same device and build)")
  p.add_argument("--abs-tolerance", type=float, default=0.0, help="absolute tolerance, for values near zero (default 0)")
  p.add_argument("--ignore", nargs="+", metavar="FIELD", default=list(DEFAULT_IGNORE),
                 help=f"fields to skip, by name at any depth or dotted prefix (default: {' '.join(DEFAULT_IGNORE)})")
  p.add_argument("--top", type=int, default=10, help="how many of the worst fields to print (default 10)")


def run(args) -> int:
  from modeld_msm.regress import regress, summary_lines, write_report
  results, messages = regress(args.new, args.ref, args.tolerance, args.abs_tolerance, tuple(args.ignore))
  failed = [r for r in results if r.regression]
  for line in summary_lines(results, args.top):
    print(line)
  n_msgs = sum(r.messages_new for r in results)
  if args.report:
    paths = write_report(args.report, results, messages, args.tolerance, tuple(args.ignore))
    print(f"report: {', '.join(str(p) for p in paths)}")
  if failed:
    print(f"REGRESSION: {len(failed)} of {len(results)} log(s) differ from the reference", file=sys.stderr)
    return 1
  print(f"PASS: {len(results)} log(s), {n_msgs} messages match (tolerance {args.tolerance})")
  return 0
