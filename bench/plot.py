"""The report's figure, ``results.png``: median time against bytes, per method.

Needs ``matplotlib`` (the ``dev`` extra), imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def plot(summary: list[dict], path: Path) -> None:
    """Median wall time (min-max bars) against bytes: saves per degree, and loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degrees = sorted({s["ranks"] for s in summary if s["phase"] == "save"})
    panels = len(degrees) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.8 * panels, 6.2))
    for ax, ranks in zip(axes[:-1], degrees, strict=True):
        rows = [s for s in summary if s["phase"] == "save" and s["ranks"] == ranks]
        draw(ax, rows, lambda s: s["method"], f"P={ranks}: saves, copies, same load")
    loads = [s for s in summary if s["phase"] in ("reshard", "unsplit")]
    label = lambda s: f"{s['method']} {s['saved_by']}->{s['ranks']}"  # noqa: E731
    draw(axes[-1], loads, label, "loads into another degree")
    fig.tight_layout()
    fig.savefig(path, dpi=56)
    plt.close(fig)


def draw(ax, rows: list[dict], label: Callable[[dict], str], title: str) -> None:
    """One line per method (the x-keys case left out); async adds its blocked time."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_prop_cycle(color=[*plt.get_cmap("tab10").colors, "black", "gold"])
    lines: dict[str, list[dict]] = {}
    for s in rows:
        if "keys" not in s["case"]:
            lines.setdefault(label(s), []).append(s)
    for name, pts in lines.items():
        pts.sort(key=lambda s: s["total_bytes"])
        x = [s["total_bytes"] / 1e9 for s in pts]
        y = [s["wall_s"] for s in pts]
        low = [s["wall_s"] - s["wall_min_s"] for s in pts]
        high = [s["wall_max_s"] - s["wall_s"] for s in pts]
        style = "--" if name.startswith(("copy", "raw")) else "-"
        bars = ax.errorbar(
            x, y, yerr=[low, high], marker="o", ms=3, capsize=2, ls=style, label=name
        )
        if any(s["blocked_s"] < s["wall_s"] for s in pts):
            blocked = [s["blocked_s"] for s in pts]
            color = bars.lines[0].get_color()
            ax.plot(x, blocked, "v:", ms=4, color=color, label=f"{name} (blocked)")
    ax.set(title=title, xlabel="GB, all ranks", ylabel="seconds, median of repeats")
    ax.set(xscale="log", yscale="log")
    ticks = sorted({p["total_bytes"] / 1e9 for pts in lines.values() for p in pts})
    ax.set_xticks(ticks, labels=[f"{t:.2f}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)


def plot_peers(
    cases: list[dict[str, dict]], names: tuple[str, ...], path: Path
) -> None:
    """``peers.png``: per degree and size, each method's median seconds (log
    scale); an async save's blocked time darker, a save that did not hold the
    values of its call hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [m for m in cases if "keys" not in next(iter(m.values()))["case"]]
    if not cases:
        return
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 5.5))
    axes = list(axes) if len(cases) > 1 else [axes]
    for ax, m in zip(axes, cases, strict=True):
        shown = [n for n in names if n in m][::-1]  # the first name on top
        y = range(len(shown))
        loads = ["load" in n for n in shown]
        colors = ["tab:green" if load else "tab:blue" for load in loads]
        held = [m[n].get("held_at_call") is not False for n in shown]
        ax.barh(y, [m[n]["wall_s"] for n in shown], color=colors, alpha=0.45)
        for i, n in enumerate(shown):
            if m[n].get("held_at_call") is not None:
                ax.barh(i, m[n]["blocked_s"], color="tab:blue", height=0.5)
            if not held[i]:
                ax.barh(i, m[n]["wall_s"], fill=False, hatch="//", edgecolor="red")
        first = next(iter(m.values()))
        ax.set_yticks(list(y), labels=shown, fontsize=7)
        ax.set_xscale("log")
        title = f"P={first['ranks']} {first['case']}"
        ax.set(title=title, xlabel="seconds, median (dark: blocked)")
        ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
