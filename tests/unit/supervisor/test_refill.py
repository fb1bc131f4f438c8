"""The spare pool refills: a used spare is replaced by a node Slurm gives the running job.

The Slurm side is :class:`~.fakes.FakeSlurm`'s job expansion: ``idle`` lists
the nodes it can give, ``prolog_flags`` what slurmctld runs with. The real
expansion runs on the dev cluster (``tests/cluster/test_spare_pool.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

from torchpass_slurm.errors import SlurmError
from torchpass_slurm.rundir import events as ev
from torchpass_slurm.slurm.steps import EXPANDED_NODE_UNSET
from torchpass_slurm.supervisor.loop import RunState
from torchpass_slurm.supervisor.refill import UNNOTICED_FACTOR

from .conftest import CONFIG, Harness, Live, at_of


def wait_thread(h: Harness) -> None:
    """The pool asks Slurm on a thread of its own: give it a moment of real time each pass."""
    h.server.on_poll.append(lambda: time.sleep(0.002) if h.supervisor.pool.asking else None)


def test_two_losses_on_one_spare_are_both_live_when_slurm_refills_the_pool(live: Live) -> None:
    h, ranks = live(refill=True)  # c1-c3 active, c4 the spare
    h.slurm.idle = ["c5"]
    wait_thread(h)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.go_silent("c3", at=12.0)
    ranks.fail_collective("c1", at=12.5)

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    promoted = [(e.fields["node"], e.fields["replaces"]) for e in h.of_kind(ev.SPARE_PROMOTED)]
    assert promoted == [("c4", "c2"), ("c5", "c3")]
    assert [e.fields["mode"] for e in h.of_kind(ev.MIGRATION_STARTED)] == ["live", "live"]
    requested = h.of_kind(ev.SPARE_REQUESTED)[0]  # then again after the second loss: no node left
    assert (requested.fields["held"], requested.fields["target"]) == (0, 1)
    (added,) = h.of_kind(ev.SPARE_ADDED)
    assert added.fields["node"] == "c5" and added.fields["spares"] == ["c5"]
    assert at_of(h, requested) <= at_of(h, added) < 12.0  # the pool was whole before the next loss
    first_done = h.of_kind(ev.MIGRATION_DONE)[0]
    assert at_of(h, added) >= at_of(h, first_done), "a node joins between recoveries, never during one"
    assert h.slurm.expansions[0] == ("c5",) and not any(h.slurm.expansions[1:])  # no idle node left
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c5"), (), ("c2", "c3"))
    # a merged node's steps ask for no cpus-per-task (Slurm would leave them pending for good)
    assert (h.slurm.unset_env["c5"], h.slurm.unset_env["c1"]) == (EXPANDED_NODE_UNSET, ())


def test_a_refusal_is_logged_and_the_pool_asks_again_later(live: Live) -> None:
    h, ranks = live(refill=True)
    wait_thread(h)
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.at(10.0, lambda: h.slurm.idle.append("c5"))  # a node comes free

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    refused = h.of_kind(ev.SPARE_REFUSED)
    assert refused and "Unable to allocate resources" in refused[0].fields["error"]
    requests = [at_of(h, e) for e in h.of_kind(ev.SPARE_REQUESTED)]
    assert all(b - a >= CONFIG.refill_retry for a, b in itertools.pairwise(requests))
    if h.slurm.expansions[-1]:  # the training may end before the retry
        assert h.of_kind(ev.SPARE_ADDED)[0].fields["node"] == "c5"


def test_with_an_allocation_prolog_the_pool_never_asks_and_says_why(live: Live) -> None:
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.idle = ["c5"]
    h.slurm.prolog_flags = "Alloc,Contain"
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert h.slurm.expansions == [] and len(h.of_kind(ev.SPARE_REQUESTED)) == 1  # once, then never
    (refused,) = h.of_kind(ev.SPARE_REFUSED)
    assert "PrologFlags=Alloc,Contain" in refused.fields["error"]


def test_without_refill_nothing_is_asked(live: Live) -> None:
    h, ranks = live()
    h.slurm.idle = ["c5"]
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    assert h.run().state == RunState.SUCCEEDED
    assert h.slurm.expansions == [] and not h.of_kind(ev.SPARE_REQUESTED)


def test_a_repaired_node_is_asked_back_once_its_slurmd_started_again(live: Live) -> None:
    """Slurm may call a dead node idle (it has not noticed yet): a lost node is asked back once
    its slurmd started again since the loss, though SlurmdTimeout has not passed."""
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started["c2"] = h.clock.time()  # slurmd up since the start
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.at(4.0, lambda: h.slurm.idle.append("c2"))  # idle to Slurm already: it has not noticed

    def repaired() -> None:  # powered on again: a new slurmd
        h.world.silent.discard("c2")
        h.slurm.started["c2"] = h.clock.time()

    h.world.at(8.0, repaired)

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    (added,) = h.of_kind(ev.SPARE_ADDED)
    assert added.fields["node"] == "c2"
    assert 8.0 <= at_of(h, added) < 8.0 + 2 * CONFIG.refill_retry
    assert h.of_kind(ev.SPARE_REFUSED), "the first requests excluded c2 and found nothing"
    m = h.supervisor.membership
    assert (m.spares, m.failed) == (("c2",), ())


def test_a_lost_node_that_never_restarted_waits_until_slurm_must_know_it_is_dead(live: Live) -> None:
    """A lost node Slurm calls idle may be dead: it is never merged into the job (Slurm would
    keep it ALLOCATED for good once it came back) until UNNOTICED_FACTOR SlurmdTimeouts after
    the loss, by when Slurm has set it down if it is. Here it was cut off from the job only, and
    its slurmd never restarted."""
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.slurmd_timeout = "2 sec"
    h.slurm.started["c2"] = h.clock.time()
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.at(4.0, lambda: h.slurm.idle.append("c2"))
    h.world.at(8.0, lambda: h.world.silent.discard("c2"))  # reachable again, the same slurmd

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    (lost,) = h.of_kind(ev.HEARTBEAT_LOST)
    (added,) = h.of_kind(ev.SPARE_ADDED)
    assert added.fields["node"] == "c2"
    assert at_of(h, added) >= at_of(h, lost) + UNNOTICED_FACTOR * 2.0
    assert len(h.of_kind(ev.SPARE_REFUSED)) >= 2


def test_a_request_still_pending_at_the_end_is_withdrawn(live: Live) -> None:
    """The supervisor's end must not leave a salloc to be granted a node nobody merges."""
    h, ranks = live(refill=True)
    release = threading.Event()

    def slow_expand(job_id: int, *, wait_s: int, exclude: object = ()) -> tuple[str, ...]:
        release.wait(30)
        raise SlurmError("salloc: Job allocation 99 has been revoked")

    h.slurm.expand_job = slow_expand  # type: ignore[method-assign]
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    result = h.run()
    release.set()

    assert result.state == RunState.SUCCEEDED
    assert h.of_kind(ev.SPARE_REQUESTED) and h.supervisor.pool.asking == 1
    assert h.slurm.withdrawn == 1


def test_a_job_of_several_tasks_per_node_is_not_refilled_and_says_why(live: Live) -> None:
    h, ranks = live(refill=True, ntasks=2)
    h.slurm.idle = ["c5"]
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    assert h.run().state == RunState.SUCCEEDED
    assert h.slurm.expansions == [] and not h.of_kind(ev.SPARE_REQUESTED)
    (refused,) = h.of_kind(ev.SPARE_REFUSED)
    assert "2 tasks per node" in refused.fields["error"]


def test_a_node_that_lost_only_its_process_comes_back_and_takes_the_next_loss(live: Live) -> None:
    """Issue 24, item 4: c2's process dies on a node Slurm calls usable. Its rank moves live to
    the spare c4, and c2 itself, once its old step has ended, is the pool's spare again: the
    pool never asks Slurm (c5 is idle, and stays so). c3's process dies next: its rank moves
    live onto c2."""
    h, ranks = live(refill=True)
    h.slurm.idle = ["c5"]
    wait_thread(h)
    h.world.crash("c2", 137, at=3.0)
    ranks.fail_collective("c1", at=3.2)
    h.world.crash("c3", 137, at=14.0)
    ranks.fail_collective("c1", at=14.2)

    result = h.run()

    assert (result.state, result.exit_code, result.restarts) == (RunState.SUCCEEDED, 0, 0)
    promoted = [(e.fields["node"], e.fields["replaces"]) for e in h.of_kind(ev.SPARE_PROMOTED)]
    assert promoted == [("c4", "c2"), ("c2", "c3")]
    assert [e.fields["mode"] for e in h.of_kind(ev.MIGRATION_STARTED)] == ["live", "live"]
    added = [(e.fields["node"], e.fields["returned"]) for e in h.of_kind(ev.SPARE_ADDED)]
    assert added == [("c2", True), ("c3", True)]
    first_done, second_started = h.of_kind(ev.MIGRATION_DONE)[0], h.of_kind(ev.MIGRATION_STARTED)[1]
    assert at_of(h, first_done) <= at_of(h, h.of_kind(ev.SPARE_ADDED)[0]) < at_of(h, second_started)
    assert not h.of_kind(ev.SPARE_REQUESTED) and h.slurm.expansions == []
    assert not h.of_kind(ev.NODE_RELEASED), "a node that outlived its rank's fault stays in the job"
    m = h.supervisor.membership
    assert (m.active, m.spares, m.failed) == (("c1", "c4", "c2"), ("c3",), ())
    # c2's standby is a step of the original allocation: it keeps the job's cpus-per-task request
    assert h.slurm.unset_env["c2"] == ()


def test_a_node_slurm_merges_twice_joins_once(live: Live) -> None:
    """Two requests in flight while the job holds for a spare: both may come back with the same
    node (Slurm shares a node between two allocations); it joins once, the job carries on."""
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.idle = []
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.go_silent("c3", at=9.0)
    ranks.fail_collective("c1", at=9.5)
    answered: list[str] = []

    def sharing_expand(job_id: int, *, wait_s: int, exclude: object = ()) -> tuple[str, ...]:
        """From 16 s on, Slurm answers c5 to the next two requests, then nothing."""
        if h.clock.elapsed < 16.0 or len(answered) >= 2:
            raise SlurmError(f"salloc: error: Unable to allocate resources within {wait_s} s")
        answered.append("c5")
        if "c5" not in h.slurm.job_nodes:
            h.slurm.job_nodes.append("c5")
            h.slurm.set_node("c5")
        return ("c5",)

    h.slurm.expand_job = sharing_expand  # type: ignore[method-assign]

    result = h.run()

    assert (result.state, result.exit_code) == (RunState.SUCCEEDED, 0)
    assert [e.fields["node"] for e in h.of_kind(ev.SPARE_ADDED)] == ["c5"]
    assert [e.fields["spares"] for e in h.of_kind(ev.MIGRATION_STARTED)] == [["c4"], ["c5"]]
    assert answered == ["c5", "c5"], "both requests came back with c5"


def test_a_lost_node_whose_slurmd_answers_is_asked_back_without_waiting(live: Live) -> None:
    """A rank froze on c2 (silent; its node and slurmd up, never restarted). Its rank moves live
    to the spare and c2 leaves the job; when the pool asks for a node, c2's slurmd accepts a
    connection, so c2 is not kept out UNNOTICED_FACTOR SlurmdTimeouts (3 min here): it is the
    new spare at once. A node whose slurmd does not answer stays out (the next test file's
    powered-off node, and test_a_lost_node_that_never_restarted_... without a probe)."""
    h, ranks = live(refill=True, probe=True)
    assert h.probe is not None
    wait_thread(h)
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started["c2"] = h.clock.time()
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.at(4.0, lambda: h.slurm.idle.append("c2"))
    h.world.at(10.0, lambda: h.world.silent.discard("c2"))  # lost and its process killed: it talks

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    (lost,) = h.of_kind(ev.HEARTBEAT_LOST)
    assert lost.fields["evidence"] != "probe"  # the probe found the node up: a frozen rank
    (added,) = h.of_kind(ev.SPARE_ADDED)
    assert (added.fields["node"], added.fields["returned"]) == ("c2", False)
    assert at_of(h, added) < at_of(h, lost) + 60.0
    assert "c2" in h.probe.now_probed


def test_a_lost_node_whose_slurmd_does_not_answer_is_kept_out(live: Live) -> None:
    h, ranks = live(refill=True, probe=True, config=dataclasses.replace(CONFIG, spare_wait=0.0))
    assert h.probe is not None
    wait_thread(h)
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started["c2"] = h.clock.time()
    h.probe.gone.add("c2")  # powered off; Slurm has not noticed and calls it idle
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)
    h.world.at(4.0, lambda: h.slurm.idle.append("c2"))

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert not h.of_kind(ev.SPARE_ADDED)
    assert "c2" in h.probe.now_probed and ("c2",) not in h.slurm.expansions


def test_a_node_lost_again_after_a_refill_brought_it_back_is_released_again(live: Live) -> None:
    """c2 is lost and released; repaired, the pool merges it back as the spare; lost again (as
    the active node it replaced c3 on), it leaves the job again. It once stayed in: the second
    release was taken for a plan naming an old loss again, and the pool, which excludes the
    job's own nodes, found no node for the next refill."""
    h, ranks = live(refill=True)
    wait_thread(h)
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started["c2"] = h.clock.time()
    h.slurm.idle = []
    h.world.go_silent("c2", at=3.0)
    ranks.fail_collective("c1", at=3.5)

    def repaired() -> None:
        h.world.silent.discard("c2")
        h.slurm.started["c2"] = h.clock.time()
        h.slurm.idle.append("c2")

    h.world.at(7.0, repaired)
    h.world.go_silent("c3", at=11.0)
    ranks.fail_collective("c1", at=11.5)
    h.world.go_silent("c2", at=15.0)
    ranks.fail_collective("c1", at=15.5)

    h.run()

    released = [e.fields["node"] for e in h.of_kind(ev.NODE_RELEASED)]
    assert released.count("c2") == 2, released
    promoted = [(e.fields["node"], e.fields["replaces"]) for e in h.of_kind(ev.SPARE_PROMOTED)]
    assert promoted[:2] == [("c4", "c2"), ("c2", "c3")], promoted


def test_a_lost_node_slurm_would_not_release_rejoins_in_place_when_it_never_went_down(live: Live) -> None:
    """Slurm 22.05 without accounting refuses every shrink: c2, lost, stays in the allocation,
    where no request can reach it (they exclude the job's nodes). Its rank froze; its node and
    slurmd never went down: it is the spare again without asking Slurm. c3, powered off and
    repaired, is not taken back so (Slurm 22.05 still counted its lost step on it)."""
    h, ranks = live(refill=True, probe=True)
    assert h.probe is not None
    wait_thread(h)
    h.slurm.shrink_error = SlurmError(
        "Job update not available right now, the DB index is being set, try again in a bit for job 4242"
    )
    h.slurm.slurmd_timeout = "60 sec"
    h.slurm.started.update({n: h.clock.time() for n in ("c2", "c3")})
    h.slurm.idle = []
    h.world.go_silent("c2", at=3.0)  # frozen: the probe finds its slurmd up
    h.world.at(10.0, lambda: h.world.silent.discard("c2"))
    h.probe.gone.add("c3")

    def power_cycled() -> None:
        h.world.silent.discard("c3")
        h.probe.gone.discard("c3")
        h.slurm.started["c3"] = h.clock.time()

    h.world.go_silent("c3", at=12.0)
    ranks.fail_collective("c1", at=12.5)
    h.world.at(15.0, power_cycled)

    result = h.run()

    assert result.state == RunState.SUCCEEDED
    assert {e.fields["node"]: e.fields["released"] for e in h.of_kind(ev.NODE_RELEASED)} == {
        "c2": False,
        "c3": False,
    }
    added = [(e.fields["node"], e.fields.get("in_job")) for e in h.of_kind(ev.SPARE_ADDED)]
    assert added == [("c2", True)], added
    assert all(e == () for e in h.slurm.expansions)
    assert "c2" not in h.supervisor.launcher.expanded  # its steps keep the job's cpus-per-task
