"""The renewer's lanes: bounded threads for store calls, per store and in all."""

from __future__ import annotations

import threading

from celery_lease._lanes import Lanes
from tests.tooling.servers import wait_for


class TestLanes:
    def test_a_store_gets_at_most_its_share_and_the_others_the_rest(self):
        """Two calls of one hung store fill its share; another store still gets a lane."""
        lanes = Lanes(total=3, per_store=2)
        release = threading.Event()
        done: list = []
        try:
            assert lanes.submit("hung", lambda: release.wait(10), done.append)
            assert lanes.submit("hung", lambda: release.wait(10), done.append)
            assert not lanes.submit("hung", lambda: None, done.append)  # its share is taken
            assert lanes.submit("other", lambda: "ok", done.append)
            wait_for(lambda: "ok" in done, 5, "the other store's call")
            assert lanes.count == 3
            assert lanes.submit("other", lambda: "again", done.append)  # the idle lane serves
            wait_for(lambda: "again" in done, 5, "a second call on the idle lane")
            assert lanes.count == 3
        finally:
            release.set()
            lanes.shutdown()
        wait_for(lambda: lanes.count == 0, 5, "the lanes to exit after shutdown")

    def test_no_lane_beyond_the_total(self):
        lanes = Lanes(total=1, per_store=2)
        release = threading.Event()
        try:
            assert lanes.per_store == 1
            assert lanes.submit("a", lambda: release.wait(10), lambda _: None)
            assert not lanes.submit("b", lambda: None, lambda _: None)
        finally:
            release.set()
            lanes.shutdown()

    def test_an_exception_reaches_the_callback_and_the_lane_lives_on(self):
        lanes = Lanes(total=1)
        done: list = []

        def boom():
            raise RuntimeError("boom")

        try:
            assert lanes.submit("a", boom, done.append)
            wait_for(lambda: done, 5, "the failed call")
            assert isinstance(done[0], RuntimeError)
            wait_for(lambda: lanes.submit("a", lambda: 1, done.append), 5, "the lane free")
            wait_for(lambda: len(done) == 2, 5, "the next call")
            assert done[1] == 1
        finally:
            lanes.shutdown()

    def test_an_idle_lane_exits(self):
        lanes = Lanes(idle_exit=0.1)
        done: list = []
        assert lanes.submit("a", lambda: 1, done.append)
        wait_for(lambda: done, 5, "the call")
        wait_for(lambda: lanes.count == 0, 5, "the idle lane to exit")
        assert lanes.submit("a", lambda: 2, done.append)  # a new lane is started on demand
        wait_for(lambda: len(done) == 2, 5, "a call on a new lane")
        lanes.shutdown()
