"""Tables and pictures for netlab measurements (measuring code never renders)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich.table import Table

from ..plan.two_level import ALGORITHMS, TwoLevelTopology, predict
from ..plan.units import fmt_bytes, fmt_time

if TYPE_CHECKING:
    from ..calibrate.links import LinkCalibration
    from .processes import HostResult


def check_table(rows: list[tuple[str, bool | None, str]]) -> Table:
    t = Table(title="gradsync netlab check")
    for col in ("what", "status", "detail"):
        t.add_column(col)
    for what, ok, detail in rows:
        status = "[green]ok[/]" if ok else ("[yellow]no (optional)[/]" if ok is None
                                              else "[red]missing[/]")
        t.add_row(what, status, detail)
    return t


def results_table(results: list[HostResult]) -> Table:
    t = Table(title="netlab run: one torchrun agent per emulated host")
    for col in ("host", "exit code", "last line"):
        t.add_column(col, overflow="fold")
    for r in results:
        code = "killed (timeout)" if r.timed_out else ("killed" if r.returncode is None
                                                        else str(r.returncode))
        t.add_row(f"h{r.host}", code, telling_line(r)[:300])
    return t


_TORCHRUN_REPORT = re.compile(r"^\s*([=\-]+|\[\d+\]:|(time|host|rank|exitcode|error_file|"
                              r"traceback)\s*:.*|Failures:|Root Cause.*|.*FAILED)\s*$")
_ERROR = re.compile(r"\berror\b|Error:", re.IGNORECASE)


def telling_line(r: HostResult) -> str:
    """The line of a host's output that says the most: after a failure, the last line
    naming an error (a worker's message, not torchrun's boxed report or traceback);
    otherwise the last line of standard output, then of standard error (warnings and
    torchrun's report left out)."""
    def kept(text: str) -> list[str]:
        return [ln.strip() for ln in text.splitlines() if ln.strip()
                and not ln.startswith("[W") and not _TORCHRUN_REPORT.match(ln)]

    out, err = kept(r.stdout), kept(r.stderr)
    if r.returncode != 0:
        errors = [ln for ln in out + err if _ERROR.search(ln) and "ChildFailedError" not in ln
                  and not ln.startswith(("File ", "raise ", "Traceback"))]
        if errors:
            return errors[-1]
    return (out or err or [""])[-1]


def links_table(cal: LinkCalibration) -> Table:
    rate = f" at {cal.rate}" if cal.rate else ""
    t = Table(title=f"Links of {cal.hosts} hosts x {cal.ranks_per_host} ranks{rate}: one "
                    f"exchange of B bytes both ways = alpha + B / bandwidth "
                    f"(median of {cal.reps})")
    for col in ("link", "pair", "sizes", "alpha", "bandwidth", "R²", "max |resid|/t",
                "at largest"):
        t.add_column(col, justify="left" if col == "link" else "right")
    for timing in (cal.intra, cal.inter):
        if timing is None:
            continue
        f = timing.fit
        t.add_row(timing.link, f"{timing.pair[0]}<->{timing.pair[1]}",
                  f"{fmt_bytes(timing.nbytes[0])}..{fmt_bytes(timing.nbytes[-1])}",
                  fmt_time(f.alpha_s), f"{f.bandwidth * 8 / 1e6:,.0f} Mbit/s",
                  f"{f.r2:.3f}", f"{100 * f.max_rel_residual:.0f}%",
                  fmt_time(timing.median_s[-1]))
    if cal.intra is None:
        t.caption = "one rank per host: no intra-host pair to time (the planner takes it as free)"
    return t


def prediction_table(topo: TwoLevelTopology, sizes: list[float]) -> Table:
    t = Table(title=f"Predicted all-reduce time, {topo.hosts} hosts x {topo.ranks_per_host} "
                    "ranks (plan.two_level with the links above)")
    t.add_column("size", justify="right")
    for a in ALGORITHMS:
        t.add_column(a, justify="right")
    t.add_column("fastest")
    for n in sizes:
        costs = {a: predict(a, n, topo) for a in ALGORITHMS}
        best = min(costs.values(), key=lambda c: c.seconds)
        t.add_row(fmt_bytes(n), *(fmt_time(costs[a].seconds) for a in ALGORITHMS),
                  best.algorithm)
    return t


def links_png(cal: LinkCalibration, path: str) -> None:
    from ..observe.plan_plots import _plt, _save

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for timing in (cal.intra, cal.inter):
        if timing is None:
            continue
        (line,) = ax.plot(timing.nbytes, [1e3 * m for m in timing.median_s], "o",
                          label=f"{timing.link} measured")
        lo, hi = timing.nbytes[0], timing.nbytes[-1]
        xs = [lo * (hi / lo) ** (k / 50) for k in range(51)]
        ax.plot(xs, [1e3 * timing.fit.predict(x) for x in xs], "-", color=line.get_color(),
                label=f"{timing.link} fit: {1e3 * timing.fit.alpha_s:.2f} ms + B / "
                      f"{timing.fit.bandwidth * 8 / 1e6:,.0f} Mbit/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("exchange time, ms (median)")
    ax.set_title(f"gradsync netlab calibrate: {cal.hosts} hosts x {cal.ranks_per_host} ranks"
                 + (f", {cal.rate}" if cal.rate else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    plt.close(fig)
