"""SIGTERM becomes `Preempted` where the process is, except inside a write to the tracking store, which runs whole."""

import os
import signal

import pytest

from harness import preemption


@pytest.fixture
def preemptible():
    before = signal.getsignal(signal.SIGTERM)
    preemption.stop_on_preemption()
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_sigterm_inside_a_tracking_write_waits_for_the_write_to_finish(preemptible):
    finished = []

    @preemption.deferring_preemption
    def write():
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-write
        finished.append("the rest of the write")
        return "written"

    with pytest.raises(preemption.Preempted, match="SIGTERM"):
        write()
    assert finished == ["the rest of the write"]


def test_a_sigterm_elsewhere_stops_the_process_where_it_is(preemptible):
    reached = []
    with pytest.raises(preemption.Preempted):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            pass
        reached.append("after")
    assert reached == []
