"""Claims on one-off study work (a baseline, the parent run), taken atomically through the study's storage.

A claim is a trial of a companion study `<study>:claims`, keyed by its user attr `claim`. Among a key's
trials that have not failed, the one with the smallest number is the claim, and taking it is Optuna's own
atomic WAITING -> RUNNING transition: of two launchers racing for one key exactly one wins, on PostgreSQL and on
SQLite (whose transactions `make_storage` makes take the write lock when they begin). The holder refreshes a
heartbeat while it works; a claim whose heartbeat is older than the grace period belongs to a dead process, so it
is failed and the key can be taken again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from enum import StrEnum

import optuna
from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)
KEY_ATTR, HEARTBEAT_ATTR = "claim", "heartbeat"


class ClaimState(StrEnum):
    FREE = "free"  # nobody holds it and it is not done: take it
    HELD = "held"  # a live process works on it
    DONE = "done"


class Claims:
    """The claims of one study."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_name: str, grace_s: float) -> None:
        self.study = optuna.create_study(study_name=f"{study_name}:claims", storage=storage, load_if_exists=True)
        self.storage, self.grace_s = storage, grace_s

    def _trials(self, key: str) -> list[FrozenTrial]:
        return sorted(
            (t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get(KEY_ATTR) == key),
            key=lambda t: t.number,
        )

    def _claim(self, key: str) -> FrozenTrial | None:
        """The key's current claim (its smallest unfailed trial), after failing a dead holder's."""
        for trial in self._trials(key):
            if trial.state == TrialState.FAIL:
                continue
            beat = trial.user_attrs.get(HEARTBEAT_ATTR)
            if trial.state == TrialState.RUNNING and beat is not None and time.time() - beat > self.grace_s:
                log.info("claim %r: its holder stopped sending heartbeats; taking it over", key)
                self._finish(trial._trial_id, TrialState.FAIL)
                continue
            return trial
        return None

    def state(self, key: str) -> ClaimState:
        claim = self._claim(key)
        if claim is None or claim.state == TrialState.WAITING:
            return ClaimState.FREE
        return ClaimState.DONE if claim.state == TrialState.COMPLETE else ClaimState.HELD

    def _take(self, key: str) -> int | None:
        claim = self._claim(key)
        if claim is None:
            self.study.enqueue_trial({}, user_attrs={KEY_ATTR: key})
            claim = self._claim(key)  # a racing launcher's enqueue may be the smaller one: same rule for both
        if claim is None or claim.state != TrialState.WAITING:
            return None
        if not self.storage.set_trial_state_values(claim._trial_id, TrialState.RUNNING):
            return None  # another launcher took it a moment ago
        self.storage.set_trial_user_attr(claim._trial_id, HEARTBEAT_ATTR, time.time())
        return claim._trial_id

    def _finish(self, trial_id: int, state: TrialState) -> None:
        with suppress(optuna.exceptions.UpdateFinishedTrialError):  # a racing launcher already ended it
            self.storage.set_trial_state_values(trial_id, state, [0.0] if state == TrialState.COMPLETE else None)

    @contextmanager
    def hold(self, key: str) -> Iterator[bool]:
        """True inside when this process now holds `key`: completed on success, failed on an exception.
        False when the work is done or a live process holds it."""
        trial_id = self._take(key)
        if trial_id is None:
            yield False
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(max(1.0, self.grace_s / 3)):
                try:
                    self.storage.set_trial_user_attr(trial_id, HEARTBEAT_ATTR, time.time())
                except Exception as error:  # a busy or unreachable database: beat again next period
                    # A heartbeat thread that died here would let another launcher take a live holder's work
                    # after the grace period (and find its run directory in use).
                    log.warning("claim %r: a heartbeat failed (%s); trying again", key, error)

        thread = threading.Thread(target=beat, name=f"claim-heartbeat-{key}", daemon=True)
        thread.start()
        try:
            yield True
        except BaseException:
            stop.set()
            thread.join()
            self._finish(trial_id, TrialState.FAIL)
            raise
        stop.set()
        thread.join()
        self._finish(trial_id, TrialState.COMPLETE)
