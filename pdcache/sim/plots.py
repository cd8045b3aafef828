"""The plots of one simulated run (`--out DIR`, unless `--no-plots`): the storage bandwidth
over time (`DIR/storage_bandwidth.png`, one line per kind: reads, prefill writes, decode
write-back) and the TTFT CDF (`DIR/ttft_cdf.png`). matplotlib is optional (`pdcache[plots]`):
without it the plots are skipped with a message saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install 'pdcache[plots]')"


def write_plots(out_dir: Path, summary: dict[str, Any],
                records: list[dict[str, Any]]) -> list[str] | str:
    """The paths written, or `NO_MATPLOTLIB`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    paths = []
    storage = summary.get("storage") or {}
    rows = storage.get("bandwidth_over_time") or []
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        times = [r["t_s"] for r in rows]
        for kind in ("read", "write_prefill", "write_decode"):
            ax.plot(times, [r[f"{kind}_Bps"] / 1e9 for r in rows], label=kind)
        ax.set(xlabel="simulated time (s)", ylabel="GB/s", title="storage bandwidth over time")
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, out_dir / "storage_bandwidth.png"))
    ttfts = sorted(r["ttft_s"] for r in records if r.get("ok") and r.get("ttft_s") is not None)
    if ttfts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post")
        ax.set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT CDF", ylim=(0, 1.02))
        paths.append(_save(fig, plt, out_dir / "ttft_cdf.png"))
    return paths


def _save(fig: Any, plt: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
