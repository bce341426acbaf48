"""Latency CDF plots as PNG: matplotlib when installed, a plain Pillow drawing otherwise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v * 1000.0 for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_cdfs(panels: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path,
              title: str = "") -> str:
    """One panel per metric, one CDF line per series; samples in seconds, axes in ms.

    panels: {"ttft": {"run A": [...], "run B": [...]}, "e2e": {...}}. Returns the backend used.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_pillow(panels, path, title)
        return "pillow"
    names = list(panels)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for label, values in panels[name].items():
            if values:
                xs, ys = _cdf(values)
                ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
        ax.set_title(name.upper())
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _plot_pillow(panels: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    w, h, pad = 360, 300, 40
    img = Image.new("RGB", (w * max(1, len(panels)), h + 20), "white")
    draw = ImageDraw.Draw(img)
    draw.text((5, 2), title, fill="black")
    for p, (name, series) in enumerate(panels.items()):
        x0 = p * w
        xmax = max((max(v) * 1000.0 for v in series.values() if v), default=1.0) or 1.0
        draw.rectangle([x0 + pad, 20 + 10, x0 + w - 10, 20 + h - pad], outline="black")
        draw.text((x0 + pad, 20 + h - pad + 5), f"{name.upper()} 0..{xmax:.3g} ms", fill="black")
        for s, (label, values) in enumerate(series.items()):
            color = _COLORS[s % len(_COLORS)]
            draw.text((x0 + pad + 5, 20 + 15 + 12 * s), label, fill=color)
            if not values:
                continue
            xs, ys = _cdf(values)
            pts = [(x0 + pad + (x / xmax) * (w - pad - 10), 20 + h - pad - y * (h - pad - 10))
                   for x, y in zip(xs, ys, strict=True)]
            if len(pts) > 1:
                draw.line(pts, fill=color, width=2)
            else:
                draw.ellipse([pts[0][0] - 2, pts[0][1] - 2, pts[0][0] + 2, pts[0][1] + 2], fill=color)
    img.save(path)
