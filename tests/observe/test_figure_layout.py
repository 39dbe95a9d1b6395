"""Figures whose text stays inside them (issue 37: the memory figure's value labels ran
across the frame and into the title). Read from the drawn figure itself: every label's
box, as matplotlib rendered it, inside the axes and clear of the title."""

import pytest

from gradsync.observe.figures_run import memory_figure
from gradsync.observe.run_data import RunData


@pytest.mark.parametrize("peaks", [[1210.0, 1185.0], [900.0, 40.0, 880.0, 905.0], [3.0]])
def test_memory_figure_labels_stay_inside_the_axes(peaks):
    run = RunData(".", metrics=[{"step": 1, "peak_mem_mb_by_rank": [p * 0.9 for p in peaks]},
                                {"step": 2, "peak_mem_mb_by_rank": peaks}])
    fig, caption = memory_figure(run)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    frame = ax.get_window_extent(renderer)
    title = ax.title.get_window_extent(renderer)
    labels = [t for t in ax.texts if t.get_text().endswith(" MiB")]
    assert [t.get_text() for t in labels] == [f"{p:,.0f} MiB" for p in peaks]
    for t in labels:
        box = t.get_window_extent(renderer)
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, t.get_text()
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1, t.get_text()  # not across the frame
        assert not box.overlaps(title), t.get_text()
    assert "each bar labelled with its value" in caption
