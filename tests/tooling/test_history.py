"""The history checker finds each kind of violation (it is the negative control of the chaos
tests' checks) and passes a clean history."""

from __future__ import annotations

import multiprocessing

from tests.tooling.history import check, load, record


def test_clean_history_passes(tmp_path):
    record(tmp_path, op="acquire", resource="r", fence=1)
    record(tmp_path, op="write", key="k", fence=1, result="ok")
    record(tmp_path, op="acquire", resource="r", fence=2)
    record(tmp_path, op="write", key="k", fence=1, result="rejected")
    record(tmp_path, op="write", key="k", fence=2, result="ok")
    record(tmp_path, op="effect", idem="i1", result="ok")
    report = check(load(tmp_path))
    report.assert_clean()
    assert report.counts["write"] == 3


def test_each_violation_is_reported():
    def e(i, **fields):
        return {"mono_ns": i, **fields}

    history = [
        e(1, op="acquire", resource="r", fence=5),
        e(2, op="acquire", resource="r", fence=5),
        e(3, op="write", key="k", fence=7, result="ok"),
        e(4, op="write", key="k", fence=6, result="ok"),
        e(5, op="effect", idem="charge-1", result="ok"),
        e(6, op="effect", idem="charge-1", result="ok"),
    ]
    report = check(history)
    assert not report.clean
    text = "\n".join(report.violations)
    assert "did not increase" in text and "stale write" in text and "2 times" in text


def _writer(directory, n):
    for i in range(200):
        record(directory, op="write", key=f"k{n}", fence=i, result="ok")


def test_concurrent_writers_never_interleave_lines(tmp_path):
    procs = [multiprocessing.Process(target=_writer, args=(tmp_path, n)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    events = load(tmp_path)
    assert len(events) == 800
    check(events).assert_clean()
