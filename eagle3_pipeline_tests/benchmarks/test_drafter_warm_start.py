"""The warm-start benchmark's table (``benchmarks/drafter_warm_start.py``): one line per arm, the start's
τ where the arm had one, mean ± sd over the seeds."""

from __future__ import annotations

from benchmarks.drafter_warm_start import table


def _row(tau: float, start: float | None = None) -> dict[str, object]:
    last = {"tau@3": tau, "accept_0": 0.5, "accept_1": 0.25, "accept_2": 0.125}
    return {"steps": 20, "start": None if start is None else {"tau@3": start}, "last": last, "best": last}


def test_the_table_has_one_line_per_arm_with_the_start_and_the_spread() -> None:
    lines = table({"warm": [_row(1.5, 1.25), _row(1.7, 1.25)], "scratch": [_row(1.25)]}, 3).splitlines()
    assert lines[0] == (
        "| arm | seeds | steps | tau@3 start | tau@3 last | tau@3 best | accept_0 | accept_1 | accept_2 (last) |"
    )
    spread = "0.500 ± 0.000 | 0.250 ± 0.000 | 0.125 ± 0.000"
    assert lines[2] == f"| warm | 2 | 20 | 1.250 ± 0.000 | 1.600 ± 0.141 | 1.600 ± 0.141 | {spread} |"
    assert lines[3] == "| scratch | 1 | 20 | — | 1.250 | 1.250 | 0.500 | 0.250 | 0.125 |"
