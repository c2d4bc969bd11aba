"""The bucket timeline: plan order, one collective per communicator, shared link."""

from __future__ import annotations

import pytest

from longboat.sim.timeline import Job, finish_times


def test_single_communicator_serialises_in_plan_order() -> None:
    jobs = [Job(0.0, 0, 0.0, 1.0), Job(0.5, 0, 0.0, 1.0), Job(5.0, 0, 0.1, 1.0)]
    assert finish_times(jobs) == pytest.approx([1.0, 2.0, 6.1])


def test_launch_waits_for_the_previous_bucket() -> None:
    # bucket 1 is ready before bucket 0, but the reducer launches in plan order
    jobs = [Job(2.0, 0, 0.0, 1.0), Job(0.0, 1, 0.0, 1.0)]
    assert finish_times(jobs) == pytest.approx([4.0, 4.0])  # both start at t=2, sharing


def test_two_communicators_share_the_link() -> None:
    jobs = [Job(0.0, 0, 0.0, 1.0), Job(0.0, 1, 0.0, 1.0)]
    assert finish_times(jobs) == pytest.approx([2.0, 2.0])


def test_latency_is_not_shared() -> None:
    jobs = [Job(0.0, 0, 1.0, 0.0), Job(0.0, 1, 1.0, 0.0)]
    assert finish_times(jobs) == pytest.approx([1.0, 1.0])


def test_overlap_hides_communication_behind_backward() -> None:
    from longboat.sim.cluster import Cluster, Link
    from longboat.sim.predict import simulate
    from longboat.strategy import Strategy
    from tests.sim.helpers import linear_profile

    prof = linear_profile([1024] * 9, backward_s=1.0)  # 8 layers of 4 MB
    slow = Cluster(2, 1, inter=Link(64e6, 0.0), intra=Link(1e12, 0.0, "nvlink"))
    one = simulate(prof, slow, Strategy(fuse_grad_size_in_MB=1000.0, last_comm_group_size_MB=1e-6))
    many = simulate(prof, slow, Strategy(fuse_grad_size_in_MB=4.0))
    assert one.buckets <= 2 and many.buckets >= 8
    assert many.exposed_comm_s < one.exposed_comm_s  # buckets overlap the rest of backward
    assert many.comm_s == pytest.approx(one.comm_s, rel=0.01)  # same bytes either way
    assert one.step_s == pytest.approx(
        prof.forward_s + one.compute_s - prof.forward_s + one.exposed_comm_s + one.optimizer_s
    )
