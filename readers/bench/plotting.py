"""The frame both bench plots share: matplotlib loaded, the recommended cell, the model's rate."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend. Raises ImportError naming the extra when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'shardpack[plot]'") from None
    return plt


def star(ax, cell) -> None:
    """The recommended ``cell``, starred at (workers, samples/s)."""
    ax.plot([cell.setting.workers], [cell.rate], "*", ms=18, mfc="none", mec="k",
            label=f"recommended: {cell.setting.label}")


def model_rate(ax, batch_size: int, step_ms: float) -> None:
    """The samples/s a model step of ``step_ms`` per batch of ``batch_size`` consumes, as a line."""
    rate = 1000 * batch_size / step_ms
    ax.axhline(rate, color="k", ls="--", lw=1,
               label=f"the model consumes {rate:,.0f} samples/s ({step_ms:.0f} ms/step)")


def save(plt, fig, ax, path) -> None:
    """Grid, legend and layout, then the PNG written to ``path`` and the figure closed."""
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
