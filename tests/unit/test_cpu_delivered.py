"""What the machine delivered to a box node (`hexctl/box/delivered.py`): the window cut
from a run's rows, the quota's wait told from the machine's, the summary per plan and
the line a held-back node prints. Readings are made up here; the integration test
`tests/integration/test_delivered_cgroups.py` reads real cgroups."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hex.run_files import TrainerRow, append_row
from hexctl.bench.system.hetero import cpu_delivered
from hexctl.bench.system.hetero_summary import delivered_summary, figures_table, summarise
from hexctl.box.delivered import (
    HELD_BACK,
    NodeCgroup,
    Reading,
    ThreadWaits,
    at,
    cut,
    delivered_block,
    held_back_lines,
    node_figures,
    read_node,
    withheld_s,
)
from hexctl.box.emulate import NodeState
from tests.unit.test_bench_hetero import _plan, _run


def _r(t: float, used: float, delay: float, thr: float = 0.0, periods: int = 0) -> Reading:
    return Reading(t, used, periods, periods // 2, thr, delay, 1)


def test_the_window_is_cut_with_its_ends_interpolated() -> None:
    rs = [_r(0, 0, 0), _r(1, 0.2, 0.5), _r(2, 0.4, 1.5)]
    mid = at(rs, 1.5)
    assert mid is not None and mid.used_s == pytest.approx(0.3)
    assert mid.run_delay_s == pytest.approx(1.0)
    assert at(rs, 2.5) is None and at(rs, -0.1) is None
    span = cut(rs, 0.5, 1.5)
    assert [r.time for r in span] == [0.5, 1, 1.5]
    assert cut(rs, 0.5, 3.0) == []  # the readings end before the window does
    assert "unavailable" in node_figures(rs, 0.2, 0.5, 3.0)


def test_the_quota_s_wait_is_not_the_machine_s() -> None:
    # a 0.2-core quota used in full: its thread waited 0.8 s a second, all but 0.05 of it
    # throttled; the wait beyond the throttling ran no CPU the quota had left
    full = [_r(t, 0.2 * t, 0.8 * t, 0.75 * t, 100 * t) for t in range(5)]
    f = node_figures(full, 0.2, 0, 4)
    assert f["used_cores"] == pytest.approx(0.2) and f["run_delay_share"] == pytest.approx(0.8)
    assert f["machine_wait_share"] == pytest.approx(0.05)
    assert f["withheld_share"] == 0.0
    assert f["throttled_share"] == pytest.approx(0.5)
    # the same quota, 0.05 used: the machine kept it waiting, the unused quota withheld
    starved = [_r(t, 0.05 * t, 0.95 * t) for t in range(5)]
    g = node_figures(starved, 0.2, 0, 4)
    assert g["withheld_cores"] == pytest.approx(0.15) and g["withheld_share"] == pytest.approx(0.75)


def test_a_wait_counted_late_is_matched_with_the_quota_it_spanned() -> None:
    # the thread waited 1.8 s without a CPU and its wait is counted when it got one, in
    # the last interval: matched against the unused quota of the time it spanned, not
    # only of the last interval
    late = [_r(0, 0, 0), _r(0.5, 0, 0), _r(1.0, 0, 0), _r(1.5, 0, 0), _r(2.0, 0.02, 1.8)]
    withheld, machine = withheld_s(late, 0.2, 0, 2)
    assert machine == pytest.approx(1.8)
    # the 1.8 s back from the end: 0.08 + 0.1 + 0.1 unused, and 0.3 s of the first 0.5
    assert withheld == pytest.approx(0.08 + 0.1 + 0.1 + 0.1 * 0.3 / 0.5)
    # idle seconds, then a busy one in which the quota was used in full: its short wait
    # is not matched with the quota left unused while the node had nothing to run
    idle_then = [_r(0, 0, 0), _r(1, 0, 0), _r(2, 0, 0), _r(3, 0.2, 0.01)]
    assert withheld_s(idle_then, 0.2, 0, 3) == (0.0, pytest.approx(0.01))
    # a node busy at its quota half the time: the quota it left unused while idle is
    # not matched with the waits after each unthrottle (0.02 s an interval)
    bursty = [_r(t / 2, 0.05 * t, 0.02 * t) for t in range(9)]
    assert withheld_s(bursty, 0.2, 0, 4) == (0.0, pytest.approx(8 * 0.02))
    # a whole core, busy: the machine's waits are the quota it did not get
    whole = [_r(t, 0.97 * t, 0.03 * t) for t in range(4)]
    assert withheld_s(whole, 1.0, 0, 3)[0] == pytest.approx(3 * 0.03)
    # a node of ten threads, one of them waiting: its wait spans back as one thread's
    many = [replace(r, threads=10, waiting=int(r.time == 2.0)) for r in late]
    assert withheld_s(many, 0.2, 0, 2) == withheld_s(late, 0.2, 0, 2)
    # a wait counted after the window falls in the time it spans, the window's part kept
    assert withheld_s(late, 0.2, 0, 1.0) == (pytest.approx(0.06 + 0.1), pytest.approx(0.8))


def test_the_block_names_the_held_back_node_and_the_run_window(tmp_path: Path) -> None:
    fine = [_r(t, 0.2 * t, 0.8 * t, 0.8 * t, 100 * t) for t in range(100, 110)]
    slow = [_r(t, 0.05 * t, 0.95 * t) for t in range(100, 110)]
    idle = [Reading(t, 0, 0, 0, 0, 0, 0) for t in range(100, 110)]
    readings = {"k0-0": fine, "k2-0": slow, "k1-0": idle}
    quotas = {"k0-0": 0.2, "k2-0": 0.2, "k1-0": 0.3}
    # the run's window: step 3 (η + 1) to the last step, by the rows' wall clock
    (tmp_path / "metrics.jsonl").touch()
    for step, t in ((1, 100.5), (2, 101.0), (3, 102.0), (4, 105.0), (5, 107.0)):
        append_row(tmp_path / "metrics.jsonl", TrainerRow(step=step, time=t))
    sampler = type("S", (), {"readings": readings})()
    nodes = [NodeCgroup(n, tmp_path, None, q) for n, q in quotas.items()]
    block = cpu_delivered(sampler, nodes, tmp_path, 3)
    assert block["window"] == {"from": 102.0, "to": 107.0, "seconds": 5.0}
    assert set(block["nodes"]) == {"k0-0", "k2-0"}  # k1-0 ran nothing
    assert block["held_back"] == ["k2-0"] and block["held_back_above"] == HELD_BACK
    (line,) = held_back_lines("plan a (async)", block)
    assert line.startswith("plan a (async): node k2-0 waited for the machine")
    assert "75% of its quota was withheld" in line
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "metrics.jsonl").touch()  # no step yet
    assert "unavailable" in cpu_delivered(sampler, nodes, tmp_path / "none", 3)
    direct = delivered_block(readings, quotas, 102.0, 107.0)
    assert direct["nodes"]["k2-0"] == block["nodes"]["k2-0"]


def _block(withheld: dict[str, float]) -> dict:
    nodes = {n: {"used_cores": 0.2 * (1 - w), "quota_cores": 0.2, "withheld_share": w}
             for n, w in withheld.items()}  # fmt: skip
    return {"nodes": nodes, "held_back": [n for n, w in withheld.items() if w > HELD_BACK]}


def test_the_plan_summary_over_its_rounds() -> None:
    rounds = [_block({"a": 0.0, "b": 0.3}), None, _block({"a": 0.02, "b": 0.05})]
    s = delivered_summary(rounds)
    assert s["held_back_in_rounds"] == [1] and s["rounds"] == 3
    assert s["nodes"]["b"]["withheld_share_max"] == 0.3
    assert s["nodes"]["b"]["withheld_share_median"] == pytest.approx(0.175)
    assert s["nodes"]["a"]["runs"] == 2
    # through the bench's summary: the figures' round's block and every round's summary
    run = {**_run(10, 10), "cpu_delivered": rounds[0], "rounds_cpu_delivered": rounds}
    out = summarise({"a": run, "b": _run(10, 10)}, {"a": _plan(1), "b": _plan(1), "c": _plan(1)})
    assert out["plans"]["a"]["cpu_delivered"] == rounds[0]
    assert out["plans"]["a"]["cpu_delivered_summary"] == s
    assert out["plans"]["a"]["rounds_cpu_delivered"] == rounds
    assert "cpu_delivered" not in out["plans"]["b"]
    assert "plan a: the machine held a node back in round(s) 1" in figures_table(out)


def test_thread_waits_add_up_over_threads_that_come_and_go(tmp_path: Path) -> None:
    def count(tid: str, wait_ns: int) -> None:
        (tmp_path / tid).mkdir(exist_ok=True)
        (tmp_path / tid / "schedstat").write_text(f"123 {wait_ns} 7\n")

    waits = ThreadWaits(str(tmp_path))
    count("10", 100)
    count("11", 50)
    assert waits.total(["10", "11", "12"]) == (150, 2, 2)  # 12 ended before its read
    count("10", 130)
    assert waits.total(["10", "11"]) == (180, 2, 1)
    (tmp_path / "11" / "schedstat").unlink()  # 11 ends: its 50 stay counted
    assert waits.total(["10"]) == (180, 1, 0)
    count("10", 20)  # the id taken by a new thread: its count starts again
    assert waits.total(["10"]) == (200, 1, 1)
    count("10", 25)
    assert waits.total(["10"]) == (205, 1, 1)
    # the real file: this thread's own wait
    me = str(threading.get_native_id())
    assert ThreadWaits().total([me])[1] == 1 and os.path.isfile(f"/proc/{me}/schedstat")


def test_a_node_s_counters_read_on_v1_and_v2(tmp_path: Path) -> None:
    me = str(threading.get_native_id())
    v1, acct, v2 = tmp_path / "cpu", tmp_path / "acct", tmp_path / "v2"
    for d in (v1, acct, v2):
        d.mkdir()
    (v1 / "cpu.stat").write_text("nr_periods 300\nnr_throttled 290\nthrottled_time 2400000000\n")
    (v1 / "tasks").write_text(f"{me}\n")
    (acct / "cpuacct.usage").write_text("600000000\n")
    (v2 / "cpu.stat").write_text(
        "usage_usec 600000\nuser_usec 1\nnr_periods 300\nnr_throttled 290\nthrottled_usec 2400000\n"
    )
    (v2 / "cgroup.threads").write_text(f"{me}\n")
    node = NodeState("k0-0", "k0", "a", "ns", "10.0.0.1", "eth0", str(v1), 0.2, 8, str(acct))
    one = NodeCgroup.of(node)
    assert one.acct == acct and one.quota_cores == 0.2
    on_v2 = NodeCgroup.of(NodeState("k0-1", "k0", "a", "ns", "10.0.0.2", "eth0", str(v2), 0.2, 8))
    assert on_v2.acct is None  # v2: the cpu cgroup's own cpu.stat counts the use
    for cg in (one, on_v2):
        r = read_node(cg, ThreadWaits())
        assert (r.used_s, r.periods, r.throttled) == (pytest.approx(0.6), 300, 290)
        assert r.throttled_s == pytest.approx(2.4) and r.threads == 1 and r.run_delay_s >= 0
