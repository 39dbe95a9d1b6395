"""The terminal's memory table names what a run holds (issue 37): a compressor's
error-feedback residual as its own row (an int8 run said "communication buffers 0.00
MiB" and nothing else), DiLoCo's outer copy as the global model (not "fp32 master
weights"), and the table titled by the method."""

from gradsync.engine.replicated.memory_report import MemoryReport


def _rows(text: str) -> dict[str, float]:
    """``  name   1.000 MiB`` lines -> {name: MiB}."""
    return {" ".join(line.split()[:-2]): float(line.split()[-2])
            for line in text.splitlines()[1:]}


def test_int8_residual_has_its_own_row():
    mib = 2**20
    rep = MemoryReport(0, 2, mib // 4, mib, mib, 0, 2 * mib, 0, 0, residuals=mib)
    text = rep.render()
    rows = _rows(text)
    assert rows["error-feedback residual"] == 1.0 and rows["communication buffers"] == 0.0
    assert rows["model state"] == 4.0  # the residual is beside the model state, not in it


def test_diloco_outer_copy_is_named_and_the_table_titled_by_the_method():
    mib = 2**20
    rep = MemoryReport(0, 2, mib // 4, mib, mib, 0, 2 * mib, 0, 0, outer_copy=mib,
                       strategy="diloco")
    text = rep.render()
    assert text.splitlines()[0].startswith("memory (diloco, per rank of 2")
    assert "master weights" not in text
    rows = _rows(text)
    assert rows["outer copy (global model)"] == 1.0 and rows["model state"] == 5.0
    assert "error-feedback residual" not in rows  # only where a run holds one
