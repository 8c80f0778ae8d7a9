"""Claims through the study storage: one winner per key under a race, takeover from a dead holder."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from studies.claims import HEARTBEAT_ATTR, Claims, ClaimState
from studies.storage import make_storage

RACER = textwrap.dedent(
    """
    import sys, time
    from studies.claims import Claims
    from studies.storage import make_storage

    url, start = sys.argv[1], float(sys.argv[2])
    claims = Claims(make_storage(url), "race", grace_s=60)
    time.sleep(max(0.0, start - time.time()))
    with claims.hold("baseline-dflash-seed0") as mine:
        if mine:
            time.sleep(1.5)  # still holding while the others look
        print("held" if mine else "not held")
    """
)


def test_of_racing_launchers_exactly_one_holds_a_key(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    Claims(make_storage(url), "race", grace_s=60)  # create the companion study once, up front
    start = time.time() + 3
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, url, str(start)], stdout=subprocess.PIPE, text=True)
        for _ in range(6)  # before SQLite transactions locked up front, six racers had two holders in 2 rounds of 6
    ]
    outputs = [racer.communicate(timeout=120)[0].strip() for racer in racers]
    assert sorted(outputs) == ["held"] + ["not held"] * 5, outputs
    assert Claims(make_storage(url), "race", grace_s=60).state("baseline-dflash-seed0") == ClaimState.DONE


def test_done_claims_stay_done_and_failed_work_is_free_again(tmp_path):
    claims = Claims(make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), "s", grace_s=60)
    assert claims.state("a") == ClaimState.FREE
    with claims.hold("a") as mine:
        assert mine and claims.state("a") == ClaimState.HELD
        with claims.hold("a") as again:
            assert not again
    assert claims.state("a") == ClaimState.DONE
    with claims.hold("a") as mine:
        assert not mine
    with pytest.raises(RuntimeError), claims.hold("b") as mine:
        assert mine
        raise RuntimeError("the baseline crashed")
    assert claims.state("b") == ClaimState.FREE


def test_a_dead_holders_claim_is_taken_over_after_the_grace_period(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    dead = Claims(make_storage(url), "s", grace_s=1)
    trial_id = dead._take("baseline")  # taken, then its process "dies": no more heartbeats
    assert trial_id is not None and dead.state("baseline") == ClaimState.HELD
    dead.storage.set_trial_user_attr(trial_id, HEARTBEAT_ATTR, time.time() - 5)
    alive = Claims(make_storage(url), "s", grace_s=1)
    with alive.hold("baseline") as mine:
        assert mine
    assert alive.state("baseline") == ClaimState.DONE


def test_a_holder_whose_heartbeat_write_fails_keeps_beating_and_keeps_its_claim(tmp_path, monkeypatch):
    """A busy database refuses a heartbeat now and then (SQLite's `database is locked` after its timeout): the holder
    beats again at the next period, so another launcher never takes a live holder's work, as a dead heartbeat
    thread let it do (the baseline's run directory then in use: CI's failure at a1c01be)."""
    import sqlalchemy

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    holder = Claims(make_storage(url), "s", grace_s=3)  # beats every second
    original, refused = holder.storage.set_trial_user_attr, []

    def busy_once(trial_id, key, value):
        if key == HEARTBEAT_ATTR and not refused and threading.current_thread().name.startswith("claim-heartbeat"):
            refused.append(value)
            raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("database is locked"))
        return original(trial_id, key, value)

    monkeypatch.setattr(holder.storage, "set_trial_user_attr", busy_once)
    other = Claims(make_storage(url), "s", grace_s=3)
    with holder.hold("baseline") as mine:
        assert mine
        time.sleep(5)  # past the grace period, with the first heartbeat refused
        assert refused, "the stand-in refused a heartbeat"
        with other.hold("baseline") as taken:
            assert not taken and other.state("baseline") == ClaimState.HELD
    assert other.state("baseline") == ClaimState.DONE
