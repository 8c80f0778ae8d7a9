"""Claims through the study storage: one winner per key under a race, takeover from a dead holder."""

import subprocess
import sys
import textwrap
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
        for _ in range(3)
    ]
    outputs = [racer.communicate(timeout=120)[0].strip() for racer in racers]
    assert sorted(outputs) == ["held", "not held", "not held"], outputs
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
