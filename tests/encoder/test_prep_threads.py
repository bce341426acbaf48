"""The prep threads: results and errors reach the waiter, tasks run in parallel, shutdown drains."""

from __future__ import annotations

import threading

import pytest

from encoder_svc.prep_threads import PrepThreads


def test_a_task_gives_its_value_or_raises_its_error():
    pool = PrepThreads(2, "test-prep")
    try:
        ok = pool.submit(lambda x: x * 2, 21)
        bad = pool.submit(lambda x: 1 / x, 0)
        assert ok.result(10) == 42 and ok.result(10) == 42  # result() can be asked again
        with pytest.raises(ZeroDivisionError):
            bad.result(10)
        assert ok.done() and bad.done()
    finally:
        pool.shutdown()


def test_tasks_run_on_named_threads_in_parallel_and_result_waits():
    pool = PrepThreads(2, "test-prep")
    gate, names = threading.Event(), []

    def held(tag):
        names.append(threading.current_thread().name)
        assert gate.wait(10)
        return tag

    try:
        first, second = pool.submit(held, "a"), pool.submit(held, "b")
        with pytest.raises(TimeoutError):
            first.result(0.05)
        assert not first.done()
        third = pool.submit(str.upper, "c")  # both threads are held: it waits its turn
        gate.set()
        assert (first.result(10), second.result(10), third.result(10)) == ("a", "b", "C")
        assert sorted(names) == ["test-prep-0", "test-prep-1"]
    finally:
        pool.shutdown()


def test_shutdown_still_runs_the_tasks_queued_before_it():
    pool = PrepThreads(1, "test-prep")
    gate, ran = threading.Event(), []
    blocker = pool.submit(lambda _: gate.wait(10), None)
    queued = [pool.submit(ran.append, i) for i in range(3)]
    pool.shutdown()
    gate.set()
    assert blocker.result(10) is True
    for task in queued:
        task.result(10)
    assert ran == [0, 1, 2]


def test_a_task_taken_over_by_another_pool_runs_once_on_whichever_reaches_it_first():
    slow, fast = PrepThreads(1, "test-slow"), PrepThreads(1, "test-fast")
    gate, runs = threading.Event(), []
    try:
        slow.submit(lambda _: gate.wait(10), None)  # the slow pool's only thread is held
        task = slow.submit(lambda tag: runs.append((tag, threading.current_thread().name)) or tag, "x")
        assert not task.started()
        fast.take_over(task)
        assert task.result(10) == "x" and task.started()
        gate.set()  # the slow pool reaches its copy now: skipped
        done = slow.submit(lambda _: None, None)
        done.result(10)
        assert runs == [("x", "test-fast-0")]
        fast.take_over(task)  # taken already: not queued again
        fast.submit(lambda _: None, None).result(10)
        assert runs == [("x", "test-fast-0")]
    finally:
        gate.set()
        slow.shutdown()
        fast.shutdown()
