"""The `--plot` figure: TTFT distribution and per-op prefetch GB/s, per backend.

Owns drawing one PNG from a bench report dict. Must not run anything; it
imports matplotlib (the optional extra `plot`) only when called.
"""
from __future__ import annotations


def plot_report(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = list(runs)
    fig, (ax_ttft, ax_gbps) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in labels:
        ttft = sorted(r["ttft_s"] for r in runs[label]["requests"])
        frac = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax_ttft.step(ttft, frac, where="post", label=label)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (s, log)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("TTFT distribution (CDF)")
    ax_ttft.legend()
    data = [runs[label]["prefetch"]["gbps_per_op"] or [0.0] for label in labels]
    ax_gbps.boxplot(data, showfliers=True)
    ax_gbps.set_xticks(range(1, len(labels) + 1), labels)
    ax_gbps.set_ylabel("GB/s per prefetch op")
    ax_gbps.set_title("Prefetch throughput per op ('none' moves no bytes)")
    cfg = report["config"]
    fig.suptitle(f"hicache-mp bench: {cfg['num_requests']} requests, "
                 f"{cfg['page_bytes'] / 2**20:g} MiB pages, policy {cfg['policy']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
