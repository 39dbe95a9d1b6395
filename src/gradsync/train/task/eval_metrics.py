"""Evaluation metrics beside the held-out loss: ``TrainData(metrics={name: fn})``.

The contract: ``fn(output, target) -> (sum, count)`` over one held-out batch --
accuracy as (correct predictions, samples), token accuracy as (correct, tokens
that are not padding), mean absolute error as (sum of |error|, elements). The
reported value is the sum over every batch of every rank divided by the count:
the exact metric over the whole held-out set, whatever the number of workers
and however the set was cut into batches (a mean of per-batch or per-rank means
is not). Sums and counts travel in float64, in the held-out loss's own
all-reduce, so metrics cost no extra collective.

Each evaluation's values go to that step's metrics.jsonl line as
``"eval_metrics": {name: value}`` and to the ``on_eval`` callbacks; a metric
whose count is 0 over the whole set is left out.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import UsageError

CONTRACT = "{name: fn(output, target) -> (sum, count)}"


def check_metrics(metrics, eval_set) -> None:
    """Refuse, in one line, metrics that cannot be evaluated (when the data is built)."""
    if metrics is None:
        return
    if not isinstance(metrics, Mapping) or not all(
            isinstance(k, str) and k and callable(v) for k, v in metrics.items()):
        raise UsageError(f"TrainData.metrics must be a dict {CONTRACT}, got {metrics!r}")
    if metrics and eval_set is None:
        raise UsageError("TrainData.metrics are computed on the held-out set: give TrainData "
                         "an eval dataset")


def metric_sums(metrics: Mapping | None, output, target) -> list[float]:
    """[sum, count] of each metric on one batch, in the order of ``metrics``."""
    sums: list[float] = []
    for name, fn in (metrics or {}).items():
        got = fn(output, target)
        try:
            total, count = got
            sums += [float(total), float(count)]
        except (TypeError, ValueError):
            raise UsageError(f"eval metric {name!r} returned {got!r}; a metric returns "
                             "(sum, count) over the batch, e.g. (correct, samples)") from None
    return sums


def metric_values(metrics: Mapping | None, totals) -> dict[str, float]:
    """{name: sum / count} from the reduced [sum, count, ...]; a count of 0 is left out."""
    values = {}
    for i, name in enumerate(metrics or {}):
        total, count = float(totals[2 * i]), float(totals[2 * i + 1])
        if count > 0:
            values[name] = total / count
    return values
