"""The end-of-run heatmaps drawn on a reused figure (normlab.analysis.render.heatmap) are a fresh figure's, byte for byte."""

from __future__ import annotations

import threading

import pytest

import normlab.analysis.render.heatmap as heatmap
from normlab import keys


def records(depth: int, steps: int, spread: float) -> list[dict]:
    """Per-layer records of `depth` blocks over `steps` steps, their values spanning a factor of about `spread`."""
    return [{"step": s, **{keys.layer_key(keys.RESID_RMS, keys.layer_label(i, depth)): 1.0 + spread * (s + i) / steps
                           for i in range(depth)}} for s in range(steps)]


def fresh(recs: list[dict], title: str) -> bytes:
    """The heatmap as a new figure draws it: this thread's figures forgotten first."""
    heatmap._figures.__dict__.pop("by_size", None)
    return heatmap.layer_heatmap(recs, keys.RESID_RMS, title)


@pytest.mark.parametrize("spread", [100.0, 2.0])  # a log colour scale (mathtext labels) and a linear one
def test_a_reused_figure_draws_what_a_fresh_one_does(spread):
    first, second = records(2, 11, spread), records(2, 11, spread * 3)
    expected = [fresh(first, "a"), fresh(second, "b")]
    heatmap._figures.__dict__.pop("by_size", None)
    drawn = [heatmap.layer_heatmap(first, keys.RESID_RMS, "a"), heatmap.layer_heatmap(second, keys.RESID_RMS, "b")]
    assert drawn[0] == expected[0] and drawn[1] == expected[1]
    assert expected[0] != expected[1]  # the figure was cleared: the second is not the first redrawn
    assert len(heatmap._figures.by_size) == 1  # one size: one figure, reused


def test_each_size_and_thread_has_its_own_figure():
    heatmap._figures.__dict__.pop("by_size", None)
    small, large = records(2, 5, 100.0), records(4, 30, 100.0)
    expected = {"small": fresh(small, "t"), "large": fresh(large, "t")}
    heatmap._figures.__dict__.pop("by_size", None)
    assert heatmap.layer_heatmap(small, keys.RESID_RMS, "t") == expected["small"]
    assert heatmap.layer_heatmap(large, keys.RESID_RMS, "t") == expected["large"]
    assert len(heatmap._figures.by_size) == 2
    other: dict = {}
    thread = threading.Thread(target=lambda: other.update(png=heatmap.layer_heatmap(small, keys.RESID_RMS, "t"),
                                                          figures=len(heatmap._figures.by_size)))
    thread.start()
    thread.join()
    assert other == {"png": expected["small"], "figures": 1}


def test_a_changed_style_draws_on_a_new_figure():
    """A figure keeps matplotlib's style (rcParams) as it was made: a user who changes it in the same process (a
    notebook) gets the heatmap a fresh figure draws in the new style, not one in the old."""
    import matplotlib

    recs = records(2, 11, 100.0)
    heatmap.layer_heatmap(recs, keys.RESID_RMS, "t")  # a figure made, and kept, in the default style
    with matplotlib.rc_context({"figure.facecolor": "0.2"}):
        reused = heatmap.layer_heatmap(recs, keys.RESID_RMS, "t")
        expected = fresh(recs, "t")
    assert reused == expected
    assert heatmap.layer_heatmap(recs, keys.RESID_RMS, "t") != expected  # back to the default style
