"""The one retry policy of calls, streams and generations (``routing.Tries``), over a router of fixed
replicas: no Ray cluster."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
from ray.exceptions import GetTimeoutError

import jitserve as js
from jitserve.cluster.ray import routing


class _Router:
    """Replicas that never change but when forgotten; the first one not tried is chosen."""

    name = "double"

    def __init__(self, *names):
        self.live = {name: routing._Member(name, None, 1, 1.0) for name in names}

    def choose(self, exclude):
        return next((member for name, member in self.live.items() if name not in exclude), None)

    def add_outstanding(self, member, rows):
        member.outstanding += rows

    def forget(self, member):
        self.live.pop(member.name, None)

    def members(self):
        return dict(self.live)


class _RayError(Exception):
    """What Ray raises for an error inside an actor: the replica's own exception as ``cause``."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def _try(router, errors, produced=0, size=4):
    """One attempt per error, which the attempt's block raises; returns the replicas tried, or raises what
    ended the request."""
    tries = routing.Tries(router, size)
    tries.produced = produced
    tried = []
    for error in errors:
        with tries.attempt() as member:
            tried.append(member.name)
            assert member.outstanding == size
            raise error
        assert member.outstanding == 0
    return tried


def test_a_lost_or_stopping_replica_is_forgotten_and_another_tried_at_most_max_tries_times():
    router = _Router("double/0", "double/1", "double/2", "double/3")
    stopping = _RayError(js.ServerStoppedError("stopping"))
    tried = _try(router, [GetTimeoutError(), stopping])
    assert tried == ["double/0", "double/1"] and sorted(router.live) == ["double/2", "double/3"]
    with pytest.raises(js.ServerStoppedError, match=r"^no replica of 'double' answered after 3 tries "
                                                    r"\(double/0: GetTimeoutError; double/1: ServerStoppedError; "
                                                    r"double/2: GetTimeoutError\)$"):
        _try(_Router("double/0", "double/1", "double/2", "double/3"), [GetTimeoutError(), stopping,
                                                                        GetTimeoutError(), GetTimeoutError()])


def test_full_queues_pass_to_the_other_choice_without_forgetting_and_all_full_is_queue_full():
    router = _Router("double/0", "double/1")
    with pytest.raises(js.QueueFullError, match=r"^every replica of 'double' has a full queue "
                                                r"\(double/0, double/1\)$"):
        _try(router, [_RayError(js.QueueFullError("full")), _RayError(js.QueueFullError("full")), None])
    assert sorted(router.live) == ["double/0", "double/1"]
    too_large = js.RequestTooLargeError("5 rows can never fit")
    with pytest.raises(js.RequestTooLargeError, match="can never fit"):
        _try(_Router("double/0", "double/1"), [_RayError(too_large), _RayError(too_large), None])


def test_a_replica_lost_after_outputs_reached_the_caller_ends_the_request():
    router = _Router("double/0", "double/1")
    with pytest.raises(js.ServerStoppedError, match=r"^replica double/0 of 'double' was lost after 2 outputs "
                                                    r"\(GetTimeoutError\)$"):
        _try(router, [GetTimeoutError()], produced=2)
    assert list(router.live) == ["double/1"]


def test_the_callers_own_errors_are_raised_as_the_replica_raised_them_and_no_replica_is_unknown():
    with pytest.raises(js.BatchError, match="^bad rows$"):
        _try(_Router("double/0", "double/1"), [_RayError(js.BatchError("bad rows"))])
    with pytest.raises(js.UnknownServerError, match=r"^no replica of 'double' is running in the ray cluster$"):
        _try(_Router(), [None])
    with pytest.raises(js.UnknownServerError):  # every replica lost and forgotten: none is left
        _try(_Router("double/0"), [GetTimeoutError(), None])
