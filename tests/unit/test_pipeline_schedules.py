"""Schedule tables (no processes): every action once, no deadlock, the textbook bubble on unit costs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sp.pipeline.partition import PipelineConfigError
from megatron_sp.pipeline.schedules import Action, build_schedule, checked_schedule, simulate, theory_bubble

LAYOUTS = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)]


@pytest.mark.parametrize("name", ["none", "1f1b", "zero_bubble"])
def test_tables_are_complete_and_deadlock_free(name: str) -> None:
    for pp, m in LAYOUTS:
        if name != "none" and m < pp:
            with pytest.raises(PipelineConfigError, match="at least pp"):
                build_schedule(name, pp, m)
            continue
        table = build_schedule(name, pp, m)
        sim = simulate(table, m)  # raises on a missing/repeated action or a deadlock
        assert len(table) == pp
        assert sum(len(t) for t in table) == pp * m * (3 if name == "zero_bubble" else 2)
        if name == "1f1b":
            assert sim.peak_in_flight == [min(pp - r, m) for r in range(pp)]
        if name == "zero_bubble":
            assert max(sim.peak_in_flight) <= pp  # 1F1B's first-stage memory, on every stage
        if name == "none":
            assert sim.peak_in_flight == [1] * pp


def test_interleaved_tables() -> None:
    for pp in (2, 3, 4):
        for v in (2, 3):
            for m in (pp, 2 * pp, 4 * pp):
                table = build_schedule("interleaved", pp, m, v)
                sim = simulate(table, m, v)
                assert sum(len(t) for t in table) == 2 * pp * m * v
                assert sim.idle == pytest.approx([theory_bubble("interleaved", pp, m, v)] * pp)
    with pytest.raises(PipelineConfigError, match="multiple of pp"):
        build_schedule("interleaved", 2, 3, 2)
    with pytest.raises(PipelineConfigError, match="virtual_stages >= 2"):
        build_schedule("interleaved", 2, 4, 1)
    with pytest.raises(PipelineConfigError, match="needs parallel.pp_schedule = interleaved"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(PipelineConfigError, match="supported"):
        build_schedule("gpipe", 2, 4)


def test_simulated_bubble_equals_theory() -> None:
    """Unit costs (F = 1, B = 2 = I + W): the tables idle exactly as the textbook says (ZB-H1: at most)."""
    for pp in (2, 4):
        for m in (4, 8, 16):
            one = simulate(build_schedule("1f1b", pp, m), m).idle
            assert one == pytest.approx([theory_bubble("1f1b", pp, m)] * pp)
            zb = simulate(build_schedule("zero_bubble", pp, m), m).idle
            assert all(theory_bubble("zero_bubble", pp, m) - 1e-9 <= z < o for z, o in zip(zb, one))
            assert simulate(build_schedule("none", pp, m), m).idle == pytest.approx([theory_bubble("none", pp, m)] * pp)
    # ZB-H1 reaches its theory at pp = 2
    assert simulate(build_schedule("zero_bubble", 2, 8), 8).idle == pytest.approx([theory_bubble("zero_bubble", 2, 8)] * 2)


def test_simulate_rejects_broken_tables() -> None:
    good = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="exactly once"):
        simulate([good[0][:-1], good[1]], 2)
    with pytest.raises(ValueError, match="appears twice"):
        simulate([good[0] + [good[0][0]], good[1]], 2)
    # stage 1 backward of micro-batch 1 before its forward of micro-batch 0 finished: everyone waits
    swapped = [list(good[0]), [Action("B", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(swapped, 2)
    with pytest.raises(ValueError, match="invalid action"):
        simulate([[Action("F", 1, 0)]], 1)


def test_zero_bubble_on_measured_costs_stays_below_1f1b() -> None:
    """W cheaper than F and I (as measured on CPU): the table built on those costs beats 1F1B, memory bound kept."""
    costs = {"F": 80.0, "B": 130.0, "I": 80.0, "W": 50.0}
    for pp in (2, 3, 4):
        for m in (4, 8, 16):
            one = simulate(build_schedule("1f1b", pp, m), m, costs=costs)
            zb = simulate(build_schedule("zero_bubble", pp, m, costs=costs), m, costs=costs)
            assert zb.makespan < one.makespan, (pp, m, zb.makespan, one.makespan)
            assert max(zb.peak_in_flight) <= pp
            table = build_schedule("zero_bubble", pp, m, costs=costs)
            for actions in table:  # I's and W's in micro-batch order: the same gradient sums for any costs
                for kind in "IW":
                    assert [a.micro_batch for a in actions if a.kind == kind] == list(range(m))


def test_checked_schedule_is_validated_once_per_layout() -> None:
    """The executor's table: build_schedule's, simulated once per (schedule, pp, m, v), not every step."""
    first = checked_schedule("interleaved", 2, 4, 2)
    assert first == tuple(map(tuple, build_schedule("interleaved", 2, 4, 2)))
    assert checked_schedule("interleaved", 2, 4, 2) is first  # cached: no rebuild, no simulation
    costs = {"F": 80.0, "B": 130.0, "I": 80.0, "W": 50.0}
    assert checked_schedule("zero_bubble", 2, 4, costs=costs) == tuple(map(tuple, build_schedule(
        "zero_bubble", 2, 4, costs=costs)))
    with pytest.raises(PipelineConfigError, match="at least pp"):
        checked_schedule("1f1b", 4, 2)


def test_tables_need_no_torch() -> None:
    """Config checks and the planner use partition and schedules without importing torch."""
    code = ("import sys, megatron_sp.pipeline.partition, megatron_sp.pipeline.schedules as s; "
            "s.checked_schedule('zero_bubble', 2, 4); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
