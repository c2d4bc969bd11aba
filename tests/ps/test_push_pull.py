"""A sync step's last push carries its pull; push buckets that hide nothing are merged."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.ps.server import CallError, Server
from longboat.ps.shared import wire
from longboat.ps.shared.auth import generate_token
from longboat.ps.shared.request import PULL_AFTER_PUSH
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.communicator import HookPusher


def _push_pull(trainer: int, then: object) -> bytes:
    meta = {"trainer": trainer, "step": 0, "lrs": [0.5], PULL_AFTER_PUSH: then}
    return wire.encode(Message(meta, {"w": torch.full((3,), float(trainer + 1))}))


def test_a_push_asking_for_the_pull_is_answered_with_the_next_values() -> None:
    server = Server(index=0, num_servers=1, token=generate_token())
    try:
        block = {"key": "w", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 0.5}}
        init = Message({"trainers": 2, "sync": True, "blocks": [block]}, {"w": torch.zeros(3)})
        server.state.init(init)
        then = {"keys": ["w"], "version": 1, "trainer": 0}
        # trainer 0 alone: its push is taken, the pull part waits for trainer 1 (deadline now)
        with pytest.raises(CallError) as info:
            server.answer("push", _push_pull(0, then), time.monotonic())
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert 0 in server.state.blocks["w"].pending  # the push itself was applied
        # trainer 1's push completes step 0: its reply is the pull of step 1
        reply = wire.decode(server.answer("push", _push_pull(1, {**then, "trainer": 1}),
                                          time.monotonic() + 60))  # fmt: skip
        want = torch.full((3,), -0.5 * (1 + 2) / 2)  # 0 - lr * mean of 1 and 2
        torch.testing.assert_close(reply.tensors["w"], want)
        with pytest.raises(CallError) as info:
            server.answer("push", _push_pull(0, ["w"]), time.monotonic() + 60)
        assert info.value.code.name == "INVALID_ARGUMENT"
        assert "'pull' must be an object" in info.value.details
        assert not server.state.blocks["w"].pending  # refused before the push applied
    finally:
        server.stop(0)


def _pusher_run(steps: int, monkeypatch: pytest.MonkeyPatch, min_lead: float) -> tuple:
    """A 4-layer model under a HookPusher with one-layer buckets; every push recorded."""
    monkeypatch.setattr(HookPusher, "MIN_LEAD_S", min_lead)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    params = list(model.parameters())
    pushed: list[list[tuple[list[int], bool]]] = [[]]
    pool = ThreadPoolExecutor(1)

    def push(indices: list[int], last: bool) -> list[Future]:
        pushed[-1].append((sorted(indices), last))
        return []

    layer_bytes = (8 * 8 + 8) * 4
    pusher = HookPusher(params, push, bucket_bytes=layer_bytes)
    try:
        for _ in range(steps):
            F.mse_loss(model(torch.randn(2, 8)), torch.zeros(2, 8)).backward()
            for f in pusher.finish():
                f.result()
            pushed.append([])
            model.zero_grad()
    finally:
        pusher.close()
        pool.shutdown()
    return pushed[:-1], pusher


def test_pusher_merges_buckets_that_would_start_too_late_to_hide_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps, pusher = _pusher_run(6, monkeypatch, min_lead=3600.0)  # no push can lead by 1 h
    assert [len(s) for s in steps] == [4, 4, 4, 4, 1, 1]  # step 0 warm-up, 3 timed, merged
    for step in steps:
        assert [last for _, last in step] == [False] * (len(step) - 1) + [True]
        assert sorted(i for indices, _ in step for i in indices) == list(range(8))
    assert len(pusher.buckets) == 1


def test_pusher_keeps_buckets_whose_pushes_lead_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps, pusher = _pusher_run(6, monkeypatch, min_lead=0.0)
    assert [len(s) for s in steps] == [4] * 6
    assert len(pusher.buckets) == 4
    assert steps[-1][0] == ([6, 7], False)  # the last layer's bucket first
