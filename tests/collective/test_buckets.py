"""Bucket planner: order, caps, layer limit, last group, dtype separation."""

import torch

from longboat.collective.buckets import (
    MB,
    GradSpec,
    assign_communicators,
    layer_of,
    plan_buckets,
)


def _specs(sizes, dtype=torch.float32, layers=None):
    return [
        GradSpec(
            i,
            f"l{i if layers is None else layers[i]}.weight",
            n,
            dtype,
            torch.device("cpu"),
            f"l{i if layers is None else layers[i]}",
        )
        for i, n in enumerate(sizes)
    ]


def _all_indices(plan):
    return [i for b in plan.buckets for i in b]


def test_every_gradient_in_exactly_one_bucket_reverse_order():
    specs = _specs([10, 2000, 30, 400_000, 5, 70])
    plan = plan_buckets(specs, cap_mb=1.0, max_layers=50, last_cap_mb=0.0001)
    assert sorted(_all_indices(plan)) == list(range(6))
    # launch order is reverse registration order, except the last group holds index 0
    assert _all_indices(plan) == [5, 4, 3, 2, 1, 0]


def test_size_cap_splits_and_big_tensor_gets_own_bucket():
    quarter = MB // 4 // 4  # a quarter MB of float32
    specs = _specs([quarter] * 4 + [MB])  # index 4 is 4 MB on its own
    plan = plan_buckets(specs, cap_mb=0.5, max_layers=50, last_cap_mb=0.25)
    assert plan.buckets[0] == (4,)
    assert all(len(b) <= 2 for b in plan.buckets)
    assert plan.buckets[-1] == (0,)


def test_tiny_cap_means_one_gradient_per_bucket():
    specs = _specs([300, 301, 302, 303])
    plan = plan_buckets(specs, cap_mb=0.001, max_layers=50, last_cap_mb=0.001)
    assert len(plan) == 4


def test_large_cap_fuses_all_but_last_group():
    specs = _specs([100] * 10)
    plan = plan_buckets(specs, cap_mb=32, max_layers=50, last_cap_mb=100 * 4 * 2 / MB)
    assert plan.buckets == ((9, 8, 7, 6, 5, 4, 3, 2), (1, 0))


def test_layer_cap_counts_modules_not_tensors():
    # weight+bias of one layer share a layer name: 6 tensors, 3 layers
    specs = [
        GradSpec(
            i,
            f"l{i // 2}.{'weight' if i % 2 == 0 else 'bias'}",
            10,
            torch.float32,
            torch.device("cpu"),
            f"l{i // 2}",
        )
        for i in range(6)
    ]
    plan = plan_buckets(specs, cap_mb=32, max_layers=1, last_cap_mb=1e-6)
    assert plan.buckets == ((5, 4), (3, 2), (1, 0))


def test_last_group_never_splits_a_layer():
    # layer l0: a 4 MB weight and a tiny bias, both over the 1 MB last-group cap together
    specs = [
        GradSpec(0, "l0.weight", MB, torch.float32, torch.device("cpu"), "l0"),
        GradSpec(1, "l0.bias", 10, torch.float32, torch.device("cpu"), "l0"),
        GradSpec(2, "l1.weight", MB, torch.float32, torch.device("cpu"), "l1"),
    ]
    plan = plan_buckets(specs, cap_mb=32, max_layers=50, last_cap_mb=1.0)
    assert plan.buckets == ((2,), (1, 0))


def test_tiny_model_is_not_split_for_a_last_group():
    # 0.6 MB of gradients after a 0.5 MB first layer: one bucket, not two latency-bound ones
    specs = _specs([128 * 1024, 100 * 1024, 50 * 1024])
    plan = plan_buckets(specs, cap_mb=32, max_layers=50, last_cap_mb=1.0)
    assert plan.buckets == ((2, 1, 0),)


def test_dtypes_never_mixed():
    specs = _specs([10, 10]) + [
        GradSpec(2, "h.weight", 10, torch.float64, torch.device("cpu"), "h"),
        GradSpec(3, "g.weight", 10, torch.float32, torch.device("cpu"), "g"),
    ]
    plan = plan_buckets(specs, cap_mb=32, max_layers=50, last_cap_mb=1e-6)
    for bucket in plan.buckets:
        assert len({specs[i].dtype for i in bucket}) == 1
    assert plan.buckets == ((3,), (2,), (1,), (0,))


def test_fusion_off_is_one_bucket_per_gradient():
    plan = plan_buckets(_specs([10, 10, 10]), fuse=False)
    assert plan.buckets == ((2,), (1,), (0,))
    assert "fusion off" in plan.describe(3)


def test_describe_names_counts_and_cap():
    plan = plan_buckets(_specs([10] * 161), cap_mb=32, max_layers=50)
    assert plan.describe(161).startswith(
        f"fused 161 gradient tensors into {len(plan)} allreduce buckets (32 MB cap"
    )


def test_describe_keeps_the_cap_as_written_and_counts_in_number():
    plan = plan_buckets(_specs([10]), cap_mb=0.02, max_layers=1)
    assert plan.describe(1, "reduce-scatter") == (
        "fused 1 gradient tensor into 1 reduce-scatter bucket (0.02 MB cap, at most 1 layer "
        "per bucket)"
    )


def test_layer_of():
    assert layer_of("encoder.0.fc.weight") == "encoder.0.fc"
    assert layer_of("scale") == ""


def test_bias_rides_with_its_weight_when_the_layer_exceeds_the_cap():
    # reverse order meets the bias first; a 2 MB cap must not leave it in a bucket of its own
    specs = [
        GradSpec(0, "fc1.weight", MB, torch.float32, torch.device("cpu"), "fc1"),
        GradSpec(1, "fc1.bias", 10, torch.float32, torch.device("cpu"), "fc1"),
        GradSpec(2, "fc2.weight", 4 * MB, torch.float32, torch.device("cpu"), "fc2"),
        GradSpec(3, "fc2.bias", 10, torch.float32, torch.device("cpu"), "fc2"),
    ]
    plan = plan_buckets(specs, cap_mb=2, max_layers=50, last_cap_mb=1.0)
    assert plan.buckets == ((3, 2), (1, 0))


def test_a_layer_far_over_the_cap_is_cut_into_cap_sized_pieces():
    quarter = MB // 4 // 4  # 0.25 MB of float32
    specs = [
        GradSpec(i, f"plist.{i}", quarter, torch.float32, torch.device("cpu"), "plist")
        for i in range(8)
    ] + [GradSpec(8, "head.weight", 10, torch.float32, torch.device("cpu"), "head")]
    plan = plan_buckets(specs, cap_mb=0.5, max_layers=50, last_cap_mb=1e-6)
    assert plan.buckets[0] == (8,)  # the head does not fit beside 2 MB of one layer
    pieces = plan.buckets[1:]
    assert [len(b) for b in pieces] == [2, 2, 2, 2]
    assert sorted(i for b in pieces for i in b) == list(range(8))


def test_communicators_balance_bytes_not_bucket_count():
    # small, large, small, large, small, large: round-robin would stack the large ones
    sizes = [20_000, 4 * MB, 8_000, 16 * MB, 8_000, 4 * MB]
    comms = assign_communicators(sizes, 2)
    assert comms == [0, 1, 0, 0, 1, 1]
    loads = [sum(s for s, c in zip(sizes, comms, strict=True) if c == k) for k in range(2)]
    assert max(loads) - min(loads) < 12 * MB  # vs 24 MB apart under round-robin
    assert assign_communicators([MB] * 4, 2) == [0, 1, 0, 1]  # equal buckets alternate
    assert assign_communicators(sizes, 1) == [0] * 6
