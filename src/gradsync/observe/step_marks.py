"""Resume points and worker counts drawn on every figure whose x axis is the step.

One object per report marks every such figure the same way and remembers which
ones it marked, so a caption mentions the dotted lines only on a figure that has
them (a caption describes what is drawn, nothing else). A run that never resumed
gets no marks and no such sentence.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.transforms as mtransforms  # noqa: E402

from .segments import Segment, resume_steps, segments, segments_text  # noqa: E402

LINE = {"color": "#555555", "ls": ":", "lw": 1.2}


class StepMarks:
    def __init__(self, records: list[dict], events: list[dict] = ()):
        self.segments: list[Segment] = segments(records, events)
        self.marked: set[str] = set()

    @property
    def resumed(self) -> bool:
        return len(self.segments) > 1

    def mark(self, name: str, fig) -> None:
        """Dotted lines at each resume on every axes of ``fig``; worker counts on the top one."""
        if not self.resumed or not fig.axes:
            return
        top = max(fig.axes, key=lambda ax: ax.get_position().y0)
        for ax in fig.axes:
            for s in self.segments[1:]:
                ax.axvline(s.first - 0.5, **LINE)
        where = mtransforms.blended_transform_factory(top.transData, top.transAxes)
        for s in self.segments:  # between the axes and the title, clear of legends and data
            top.text(s.first - 0.4, 1.01, s.workers, transform=where, fontsize=7,
                     va="bottom", ha="left", color="#333333")
        if top.get_title():
            top.set_title(top.get_title(), pad=14)
        self.marked.add(name)

    def caption(self, name: str) -> str:
        """The sentence for ``name``'s caption, or "" when its figure was not marked."""
        if name not in self.marked:
            return ""
        steps = resume_steps(self.segments)
        after = f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}"
        return (f" Dotted lines: the run resumed after {after}; the label at the top of "
                f"each stretch is its worker count ({segments_text(self.segments)}).")
