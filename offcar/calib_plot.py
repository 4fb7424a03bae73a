"""A calibration written by `modeld-msm calibrate-a630`, drawn: each kernel launch's measured time against the fitted
cost model's, and the whole frames of both legs (waits for idle kept, independent ones dropped) against what the kernels
alone add up to, one colour per artifact. It reads the calibration's JSON alone, so a device's file fitted on the build
machine draws the same."""
from __future__ import annotations

from pathlib import Path

from selfdrive_glue.files import replacing


def plot_calibration(cal: dict, path: Path) -> None:
  """cal: calibrate-a630's JSON with its fit (each artifact's `residuals`). -> a PNG at path, written atomically."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  arts = cal["artifacts"]
  timed = [a for a in arts if a.get("frames")]
  fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 6.5, 5.5), squeeze=False)
  colour = {a["artifact"]: f"C{i}" for i, a in enumerate(arts)}
  ax = axes[0][0]
  for a in arts:
    for is_variant, marker, what in ((False, "o", ""), (True, "^", " (tile variants)")):
      pts = [(r["measured_us"], r["fitted_us"]) for r in a["residuals"] if (r.get("variant_of") is not None) == is_variant]
      if pts:
        ax.scatter([m for m, _ in pts], [f for _, f in pts], s=14, marker=marker, alpha=0.7, color=colour[a["artifact"]],
                   label=f"{a['artifact']} {a['kind']}{what}")
  rs = [r for a in arts for r in a["residuals"]]
  every = [v for r in rs for v in (r["measured_us"], r["fitted_us"])]
  lo, hi = min(every) / 1.5, max(every) * 1.5
  ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="fitted = measured")
  for s in (0.8, 1.2):
    ax.plot([lo, hi], [lo * s, hi * s], "k:", lw=0.6)
  ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured us (alone)", ylabel="fitted model us")
  worst = max(abs(r["fitted_us"] - r["measured_us"]) / r["measured_us"] for r in rs)
  consts = ", ".join(f"{k} {v:.3g}" for k, v in (cal.get("constants") or {}).items() if k in ("tex_rate", "launch_us", "hide_waves"))
  ax.set_title(f"{len(rs)} kernel launches: worst residual {100 * worst:.1f} % (dotted: +-20 %)\nfitted {consts}", fontsize=9)
  ax.legend(loc="upper left", fontsize=7)
  if timed:
    ax = axes[0][1]
    for a in timed:
      f, c = a["frames"], colour[a["artifact"]]
      ax.plot(range(len(f["waits_kept"]["ms"])), f["waits_kept"]["ms"], "o-", ms=4, lw=1, color=c, label=f"{a['artifact']}: waits kept")
      if "ms" in (b := f.get("independent_waits_dropped") or {}):
        safe = "outputs identical" if b.get("safe") else "UNSAFE"
        ax.plot(range(len(b["ms"])), b["ms"], "s--", ms=4, lw=1, color=c, label=f"independent waits dropped ({b.get('waits_dropped', '?')}; {safe})")
      ax.axhline(f["kernels_alone_ms"], color=c, lw=0.8, ls=":", label="its kernels alone, added up")
    ax.set(xlabel="frame", ylabel="ms", ylim=(0, None))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(f"frames as served ({timed[0]['frames'].get('clock', '?')})", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
  fig.suptitle(f"calibrate-a630: {cal.get('path', '?')} on {cal.get('device', '?')} ({cal.get('clock', '?')})", fontsize=10)
  fig.tight_layout()
  with replacing(path, ".png") as tmp:
    fig.savefig(tmp, dpi=80)
  plt.close(fig)
