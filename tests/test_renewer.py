"""The renewal thread and the interrupter, in one process.

The store is the real MemoryLeaseStore behind a fault injector (it fails, hangs or counts calls
on demand); real workers are covered in tests/integration.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import threading
import time

import pytest

import celery_lease
from celery_lease import FenceGate, LeaseLostError, LeaseStoreError, Owner
from celery_lease import _renewer as renewer_module
from celery_lease._interrupt import Interrupter, LeaseInterrupt, shielded
from celery_lease._renewer import Renewer
from celery_lease.stores import MemoryLeaseStore
from tests.tooling.servers import wait_for


class FaultyStore(MemoryLeaseStore):
    """A real memory store whose renew_many can fail, raise or hang on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.mode = "ok"
        self.release_hang = threading.Event()
        self.warm_ups = 0

    def warm_up(self):
        self.warm_ups += 1
        super().warm_up()

    def renew_many(self, leases, ttl=None):
        self.calls.append(len(leases))
        if self.mode == "error":
            raise LeaseStoreError("injected store failure")
        if self.mode == "bug":
            raise RuntimeError("injected bug")
        if self.mode == "hang":
            self.release_hang.wait(30)
        if self.mode == "hang_once":  # one connection stopped answering; the others answer
            self.mode = "ok"
            self.release_hang.wait(30)
        return super().renew_many(leases, ttl)


@pytest.fixture
def store():
    return FaultyStore()


@pytest.fixture
def renewer():
    instance = Renewer()
    yield instance
    instance.shutdown()


def lost_recorder():
    lost: list[tuple[str, str, float]] = []

    def on_lost(hold, error):
        lost.append((hold.lease.resource, error.reason, time.monotonic()))

    return lost, on_lost


class TestRenewer:
    def test_renews_every_held_lease_in_one_call_per_tick(self, store, renewer):
        """Three leases, one thread, batched calls; expiries move forward."""
        lost, on_lost = lost_recorder()
        others = sum(t.name == "celery-lease-renewer" for t in threading.enumerate())
        leases = [store.acquire(f"r{i}", Owner.new(), 0.6) for i in range(3)]
        before = [lease.expires_at for lease in leases]
        for lease in leases:
            renewer.hold(lease, interval=0.2, max_runtime=60, on_lost=on_lost)
        pairs = list(zip(leases, before, strict=True))
        wait_for(lambda: all(lease.expires_at > b for lease, b in pairs), 5, "renew")
        assert 3 in store.calls  # all three in one store call
        # one thread for the three leases (other renewers of this test process may be idling)
        assert sum(t.name == "celery-lease-renewer" for t in threading.enumerate()) == others + 1
        assert not lost

    def test_a_failed_batch_leaves_the_batches_before_it_renewed(self, store, renewer, monkeypatch):
        """More leases due than RENEW_BATCH go out in batches, one after another on the lane:
        when the third batch fails, the leases of the first two count as renewed (rescheduled a
        full interval on, not retried), only the failed batch's are retried, and none is lost.
        (Before: one store call for all six, so one failure retried every lease.)"""
        monkeypatch.setattr(renewer_module, "RENEW_BATCH", 2, raising=False)
        lost, on_lost = lost_recorder()
        failing: set[str] = set()
        batches: list[list[str]] = []
        real = store.renew_many

        def renew_many(leases, ttl=None):
            names = [lease.resource for lease in leases]
            batches.append(names)
            if len(batches) == 3:  # the third batch of the first tick fails, and stays failing
                failing.update(names)
            if failing.intersection(names):
                raise LeaseStoreError("injected failure of one batch")
            return real(leases, ttl)

        monkeypatch.setattr(store, "renew_many", renew_many)
        leases = [store.acquire(f"r{i}", Owner.new(), 3.0) for i in range(6)]
        before = {lease.resource: lease.expires_at for lease in leases}
        holds = [
            renewer.hold(lease, interval=0.6, max_runtime=60, on_lost=on_lost) for lease in leases
        ]
        wait_for(lambda: len(batches) >= 4, 10, "a retry of the failed batch")
        assert [len(b) for b in batches[:3]] == [2, 2, 2]
        renewed = set(batches[0] + batches[1])
        assert failing == set(batches[2]) and not renewed & failing
        with renewer._mutex:
            for hold in holds:
                name = hold.lease.resource
                if name in renewed:
                    assert hold.lease.expires_at > before[name] and not hold.retrying
                    assert hold.next_due >= hold.lease.sent_monotonic + 0.6 * (1 - 0.15) - 1e-6
                else:
                    assert hold.lease.expires_at == before[name] and hold.retrying
        assert all(set(b) <= failing for b in batches[3:])  # only the failed batch is retried
        failing.clear()
        wait_for(
            lambda: all(lease.expires_at > before[lease.resource] for lease in leases), 5, "renew"
        )
        assert not lost

    def test_the_first_renewal_follows_a_pinned_random_uniform(self, store, monkeypatch):
        """A test that pins random.uniform (the earliest renewal: the full jitter) gets it for
        the first renewal too, as for every later one; a seeded random draws the same values
        as uniform(0, JITTER) would."""
        import random

        lease = store.acquire("r", Owner.new(), 30)
        monkeypatch.setattr(random, "uniform", lambda a, b: b)
        _, on_lost = lost_recorder()
        hold = renewer_module.Hold(lease, 10.0, 60, on_lost)
        assert hold.next_due == lease.sent_monotonic + 10.0 * (1 - renewer_module.JITTER)
        monkeypatch.undo()
        random.seed(7)
        due = [renewer_module.Hold(lease, 10.0, 60, on_lost).next_due for _ in range(3)]
        random.seed(7)
        jitters = [random.uniform(0, renewer_module.JITTER) for _ in range(3)]
        assert due == [lease.sent_monotonic + 10.0 * (1 - j) for j in jitters]

    def test_store_errors_are_retried_until_the_self_fence_deadline(self, store, renewer):
        """A failing store is retried; at the deadline the lease is declared lost, not later."""
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 0.8)
        store.mode = "error"
        renewer.hold(lease, interval=0.25, max_runtime=60, on_lost=on_lost)
        wait_for(lambda: lost, 5, "loss")
        _, reason, at = lost[0]
        assert reason == "renew_failed" and len(store.calls) >= 2
        assert at >= lease.deadline - 0.05  # not before the deadline
        assert at < lease.deadline + 0.2  # promptly after it
        assert lease.lost is not None

    def test_failed_renewals_are_paced_not_a_hot_loop(self, store, renewer):
        """A store that fails at once is retried every interval/4 or so, not back to back.

        (The coalescing window that batches renewals due soon must not make a retry due again
        at once: that spun on a down PostgreSQL, 176 calls in under 2 s, each logged.)
        """
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 6.0)
        store.mode = "error"
        renewer.hold(lease, interval=1.0, max_runtime=60, on_lost=on_lost)
        store.calls.clear()
        time.sleep(1.5)  # a window to count in, not a wait for an outcome
        calls = len(store.calls)
        print(f"{calls} renewal calls in 1.5 s against a failing store")
        assert 2 <= calls <= 10  # about one per interval/4 = 0.25 s
        assert not lost  # the deadline (4.5 s) is still ahead

    def test_a_hung_store_cannot_stall_the_watchdog(self, store, renewer):
        """The deadline fires while the store call still hangs (its I/O runs elsewhere)."""
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 0.6)
        store.mode = "hang"
        renewer.hold(lease, interval=0.15, max_runtime=60, on_lost=on_lost)
        try:
            wait_for(lambda: lost, 5, "loss while the store hangs")
            assert lost[0][1] == "renew_failed"
            assert lost[0][2] < lease.deadline + 0.2
        finally:
            store.release_hang.set()

    @pytest.mark.parametrize(("lanes", "kept"), [(None, True), (1, False)])
    def test_a_renewal_unanswered_for_an_interval_is_sent_again_on_another_lane(
        self, store, lanes, kept
    ):
        """One hung call costs its lease one interval, not the lease (a renewal is repeatable).

        ``lanes=1`` is the negative control: nowhere to send it again, the lease is lost.
        """
        renewer = Renewer() if lanes is None else Renewer(lanes=lanes)
        try:
            lost, on_lost = lost_recorder()
            lease = store.acquire("r", Owner.new(), 0.9)
            store.mode = "hang_once"
            renewer.hold(lease, interval=0.3, max_runtime=60, on_lost=on_lost)
            first = lease.sent_monotonic
            wait_for(lambda: lease.sent_monotonic > first or lost, 5, "a renewal or a loss")
            print(f"lanes={lanes}: {len(store.calls)} calls, {lost=}")
            assert (not lost) is kept
        finally:
            store.release_hang.set()
            renewer.shutdown()

    def test_a_slow_on_lost_callback_does_not_delay_another_leases(self, store, renewer):
        """Each loss is delivered on a thread of its own: a callback that blocks delays none."""
        lost, on_lost = lost_recorder()
        blocked = threading.Event()

        def stuck(hold, error):
            blocked.wait(10)

        try:
            first = store.acquire("first", Owner.new(), 0.5)
            renewer.hold(first, interval=0.1, max_runtime=0.2, on_lost=stuck)
            time.sleep(0.05)  # so that the second cap comes after the first, not a wait
            second = store.acquire("second", Owner.new(), 0.5)
            start = time.monotonic()
            renewer.hold(second, interval=0.1, max_runtime=0.2, on_lost=on_lost)
            wait_for(lambda: lost, 5, "the second loss")
            # (the first callback blocks for 10 s: anything near that is the old serial delivery)
            assert lost[0][1] == "max_runtime" and lost[0][2] - start < 2.0
        finally:
            blocked.set()

    def test_a_taken_over_lease_is_reported_with_the_new_holder(self, store, renewer):
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 0.6)
        renewer.hold(lease, interval=0.1, max_runtime=60, on_lost=on_lost)
        store.force_release("r")
        store.acquire("r", Owner.new("intruder"), 30)
        wait_for(lambda: lost, 5, "loss")
        assert lost[0][1] == "taken_over"
        assert lease.lost.holder_label == "intruder"

    def test_the_runtime_cap_ends_renewal(self, store, renewer):
        """A lease that would be renewed forever is given up at max_runtime."""
        lost, on_lost = lost_recorder()
        # (a 3 s ttl: a renewer that let the lease run out instead would end at 3.7 s or
        # later, so the bound can allow a loaded box's late thread: 0.9 s failed in a CI
        # rehearsal by 4 ms)
        lease = store.acquire("r", Owner.new(), 3.0)
        start = time.monotonic()
        renewer.hold(lease, interval=0.1, max_runtime=0.7, on_lost=on_lost)
        wait_for(lambda: lost, 10, "cap")
        assert lost[0][1] == "max_runtime"
        assert 0.7 <= lost[0][2] - start < 0.7 + 1.0

    def test_no_renewal_after_drop(self, store, renewer):
        """A dropped (released) lease is never renewed again: no zombie renewer."""
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 0.6)
        hold = renewer.hold(lease, interval=0.1, max_runtime=60, on_lost=on_lost)
        wait_for(lambda: store.calls, 5, "first renewal")
        renewer.drop(hold)
        calls = len(store.calls)
        expires = lease.expires_at
        time.sleep(0.4)  # several intervals: any renewal would have happened
        assert len(store.calls) == calls and lease.expires_at == expires and not lost

    def test_an_unexpected_error_does_not_kill_the_thread(self, store, renewer, caplog):
        """A bug in a renewal is logged; the thread goes on and renews once it is gone."""
        lost, on_lost = lost_recorder()
        lease = store.acquire("r", Owner.new(), 1.5)
        store.mode = "bug"
        renewer.hold(lease, interval=0.1, max_runtime=60, on_lost=on_lost)
        wait_for(lambda: len(store.calls) >= 2, 5, "retries after the bug")
        store.mode = "ok"
        before = lease.expires_at
        wait_for(lambda: lease.expires_at > before, 5, "renewal after recovery")
        assert renewer.thread is not None and renewer.thread.is_alive()
        assert "renewal raised unexpectedly" in caplog.text
        assert not lost

    def test_a_store_is_warmed_up_once_however_many_leases(self, store, renewer):
        """Round trips to the store: one warm-up, then renewals only, for every later lease.

        (Creating the I/O executor cleared the warm mark that the first hold had just set, so
        the second lease paid a second warm-up round trip before its first renewal.)
        """
        lost, on_lost = lost_recorder()
        renewer.prepare(store)  # what a task does before its claim
        wait_for(lambda: store.warm_ups, 5, "the warm-up")
        for i in range(3):
            lease = store.acquire(f"r{i}", Owner.new(), 0.6)
            before = lease.expires_at
            renewer.hold(lease, interval=0.2, max_runtime=60, on_lost=on_lost)
            wait_for(lambda: lease.expires_at > before, 5, f"lease {i} renewed")  # noqa: B023
        print(f"{store.warm_ups} warm-ups, {len(store.calls)} renewal calls")
        assert store.warm_ups == 1
        assert not lost

    def test_the_thread_exits_when_idle(self, store, renewer, monkeypatch):
        monkeypatch.setattr(renewer_module, "IDLE_EXIT", 0.2)
        lease = store.acquire("r", Owner.new(), 0.6)
        hold = renewer.hold(lease, interval=0.1, max_runtime=60, on_lost=lambda *a: None)
        thread = renewer.thread
        renewer.drop(hold)
        wait_for(lambda: not thread.is_alive(), 5, "idle exit")


class TestInterrupter:
    def test_signal_mode_interrupts_a_sleeping_main_thread(self):
        """In a process's main thread a lost lease breaks even time.sleep."""
        foreign = []
        previous = signal.signal(signal.SIGUSR1, lambda *args: foreign.append(args[0]))
        try:
            interrupter = Interrupter()
            assert interrupter.mode == "signal"
            interrupter.arm()
            timer = threading.Timer(0.1, interrupter.interrupt)
            timer.start()
            started = time.monotonic()
            with pytest.raises(LeaseInterrupt):
                time.sleep(5)
            assert time.monotonic() - started < 2
            interrupter.disarm()
            # A SIGUSR1 that is not ours (billiard's soft time limit) reaches its own handler.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            wait_for(lambda: foreign, 5, "the replaced handler to run")
        finally:
            signal.signal(signal.SIGUSR1, previous)

    def test_async_mode_interrupts_a_worker_thread(self):
        caught = []

        def body():
            interrupter = Interrupter()
            assert interrupter.mode == "async-exception"
            interrupter.arm()
            box.append(interrupter)
            try:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    time.sleep(0.01)
            except LeaseInterrupt as exc:
                caught.append(exc)
            finally:
                interrupter.disarm()

        box: list[Interrupter] = []
        thread = threading.Thread(target=body)
        thread.start()
        wait_for(lambda: box, 5, "armed")
        assert box[0].interrupt()
        thread.join(10)
        assert caught and isinstance(caught[0], LeaseInterrupt)

    def test_an_interrupt_waits_for_a_shielded_store_call(self):
        """Arriving inside a store call, it is raised when the call returns, not inside it."""
        interrupter = Interrupter()
        interrupter.arm()
        finished_call = []

        def store_call():
            with shielded():
                assert interrupter.interrupt()  # held back: nothing is raised in here
                time.sleep(0.05)
                finished_call.append(True)

        with pytest.raises(LeaseInterrupt):
            store_call()
        assert finished_call == [True]
        interrupter.disarm()

    def test_disarmed_interrupter_sends_nothing(self):
        interrupter = Interrupter()
        interrupter.arm()
        interrupter.disarm()
        assert interrupter.interrupt() is False
        time.sleep(0.05)  # nothing raised


class TestSwallowedInterrupts:
    """``LeaseInterrupt`` gets through ``except Exception``, and is not forgotten if swallowed."""

    def test_it_is_a_base_exception_that_pickles(self):
        """Not an Exception (so a retry loop lets it through); rebuilt from its args."""
        exc = LeaseInterrupt("the lease was lost")
        assert isinstance(exc, BaseException) and not isinstance(exc, Exception)
        assert celery_lease.LeaseInterrupt is LeaseInterrupt
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is LeaseInterrupt and str(again) == "the lease was lost"
        assert str(LeaseInterrupt(*exc.args)) == str(exc) and str(LeaseInterrupt()) != ""

    @staticmethod
    def _retry_loop(swallowed, seconds=3.0):
        """A body's retry loop around a flaky call: ``except Exception: try again``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                time.sleep(0.01)
            except Exception as exc:  # the point of the test
                swallowed.append(exc)

    def test_it_escapes_except_exception_in_the_main_thread(self):
        """Signal mode (prefork, solo): the retry loop ends with the interrupt."""
        interrupter = Interrupter()
        assert interrupter.mode == "signal"
        interrupter.arm()
        swallowed: list[BaseException] = []
        timer = threading.Timer(0.05, interrupter.interrupt)
        timer.start()
        try:
            with pytest.raises(LeaseInterrupt):
                self._retry_loop(swallowed)
        finally:
            timer.join()
            interrupter.disarm()
        assert swallowed == []

    def test_it_escapes_except_exception_in_a_worker_thread(self):
        """Async-exception mode (threads pool): the retry loop ends with the interrupt."""
        box: list[Interrupter] = []
        swallowed: list[BaseException] = []
        ended: list[BaseException | None] = []

        def body():
            interrupter = Interrupter()
            interrupter.arm()
            box.append(interrupter)
            try:
                self._retry_loop(swallowed)
                ended.append(None)
            except LeaseInterrupt as exc:
                ended.append(exc)
            finally:
                interrupter.disarm()

        thread = threading.Thread(target=body)
        thread.start()
        wait_for(lambda: box, 5, "armed")
        assert box[0].interrupt()
        thread.join(10)
        assert swallowed == [] and isinstance(ended[0], LeaseInterrupt)

    def test_cleanup_while_the_interrupt_propagates_still_makes_its_store_calls(self):
        """A ``finally`` that closes a connection (a store call, shielded) while the interrupt
        is on its way out runs; raising it again there would skip the close and leave the
        transaction, and its row locks, open (seen: the lost-update test on PostgreSQL stalled
        with 0 of 200 increments done)."""
        interrupter = Interrupter()
        interrupter.arm()
        cleaned: list[str] = []
        timer = threading.Timer(0.05, interrupter.interrupt)

        def body() -> None:
            timer.start()
            try:
                time.sleep(5)
            finally:
                with shielded():  # conn.close(): rolls the transaction back
                    cleaned.append("closed")
                try:
                    raise ValueError("a cleanup step fails and is handled")
                except ValueError:
                    with shielded():
                        cleaned.append("rolled back")

        try:
            with pytest.raises(LeaseInterrupt):
                body()
        finally:
            timer.join()
            interrupter.disarm()
        assert cleaned == ["closed", "rolled back"]

    def test_a_swallowed_interrupt_is_raised_again_by_check_store_calls_and_fenced_writes(
        self, tmp_path
    ):
        """A bare ``except:`` swallows it; the next check(), gate admission or fenced write
        raises it again and writes nothing. Once the body is over (disarmed), check() raises
        the LeaseLostError and store calls (the release) run."""
        import sqlalchemy as sa

        from celery_lease.fencing import fenced_update

        store = MemoryLeaseStore()
        lease = store.acquire("swallowed", Owner.new(), 30)
        engine = sa.create_engine(f"sqlite:///{tmp_path}/side.db")
        table = sa.Table(
            "t",
            sa.MetaData(),
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("v", sa.Integer),
            sa.Column("fence", sa.BigInteger),
        )
        table.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert().values(id=1, v=0, fence=None))
        interrupter = Interrupter()
        interrupter.arm()
        try:
            # What the renewer does: record the loss, then interrupt the body.
            lease.mark_lost(LeaseLostError.lost(lease.resource, lease.fence, "released"))
            threading.Timer(0.05, interrupter.interrupt).start()
            with contextlib.suppress(BaseException):  # the body swallows everything
                time.sleep(5)
            with pytest.raises(LeaseInterrupt):
                lease.check()
            with pytest.raises(LeaseInterrupt):
                FenceGate(store=store).admit("k", lease)
            with engine.begin() as conn, pytest.raises(LeaseInterrupt):
                fenced_update(conn, table, table.c.id == 1, {"v": 1}, lease)
            with pytest.raises(LeaseInterrupt), shielded():
                pass  # any store call
        finally:
            interrupter.disarm()
        with pytest.raises(LeaseLostError):
            lease.check()
        with shielded():
            pass
        with engine.connect() as conn:
            assert conn.execute(sa.select(table.c.v)).scalar() == 0
        engine.dispose()
