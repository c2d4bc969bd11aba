"""``hvd.elastic`` (Horovod's elastic API on ``lb.elastic``).

Single process: TorchState commit/restore/sync, HostsUpdatedInterrupt, the sampler's Horovod
names, DistributedOptimizer.rebuild. End to end: Horovod's elastic flow
(tests/compat/hvd_elastic_probe.py) on 3 ``longboat launch --nnodes 2:3`` launchers, one node
lost mid-epoch, or one joining; the final parameters must agree on every rank and with a
single-process replay of exactly the committed global batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

import longboat as lb
import longboat.horovod.torch as hvd
from longboat.elastic import world
from longboat.elastic.failures import is_peer_failure
from tests.compat import hvd_elastic_probe as probe
from tests.elastic import _cluster
from tests.elastic._replay import replay_steps

pytestmark = pytest.mark.slow  # slow tier: Horovod elastic runs that lose and gain nodes

SAMPLES = 96


@pytest.fixture
def horovod():
    hvd.init()
    yield hvd
    hvd.shutdown()
    lb.shutdown()  # the process group too: later tests read the cluster from the environment


def _setup(horovod, lr: float = 0.1):
    net = probe.model()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    opt = horovod.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    return net, opt


def _step(net, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    F.mse_loss(net(x), y).backward()
    opt.step()


def _params(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


# -- single process ---------------------------------------------------------------------------


def test_exceptions_are_horovods_names_over_lb_elastic():
    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError
    assert issubclass(hvd.elastic.HostsUpdatedInterrupt, world.MembershipChanged)
    assert hvd.elastic.TorchState.__mro__[1] is hvd.elastic.State


def test_commit_then_restore_goes_back_to_the_commit(horovod):
    net, opt = _setup(horovod)
    state = hvd.elastic.TorchState(net, opt, batch=0, epoch=0)
    _step(net, opt, 1)
    state.batch += 1
    state.commit()
    committed, momentum = _params(net), opt.state_dict()["state"][0]["momentum_buffer"].clone()
    _step(net, opt, 2)
    state.batch += 1
    state.epoch = 3
    state.restore()
    assert (state.batch, state.epoch, state.commits) == (1, 0, 1)
    for got, want in zip(_params(net), committed, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_save_is_a_snapshot_without_counting_a_step(horovod):
    net, opt = _setup(horovod)
    state = hvd.elastic.TorchState(model=net, optimizer=opt, batch=0)
    state.batch = 5
    state.save()
    state.batch = 7
    state.restore()
    assert state.batch == 5 and state.commits == 0


def test_commit_raises_hosts_updated_when_membership_changed(horovod, monkeypatch):
    net, opt = _setup(horovod)
    state = hvd.elastic.TorchState(net, opt, batch=0)
    monkeypatch.setattr(world, "change_pending", lambda: True)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt):
        state.commit()
    assert state.commits == 1  # the step was saved before the check
    with pytest.raises(world.MembershipChanged):
        state.check_host_updates()


def test_sync_and_reset_callbacks_single_process(horovod):
    net, opt = _setup(horovod)
    calls = []
    state = hvd.elastic.TorchState(net, opt, batch=2)
    state.register_reset_callbacks([lambda: calls.append(hvd.size())])
    assert state.sync() == 0
    state.on_reset()  # rebuilds the optimizer for the (same) world, then the callbacks
    assert calls == [1]
    _step(net, opt, 3)  # still trains after the rebuild


def test_object_state_keeps_plain_values(horovod):
    state = hvd.elastic.ObjectState(bcast_object=None, get_rank=hvd.rank, epoch=1, names=["a"])
    state.epoch = 2
    state.names.append("b")
    state.commit()
    state.epoch = 9
    state.restore()
    assert state.epoch == 2 and state.names == ["a", "b"]


def test_torch_state_takes_a_sampler_under_any_name_and_refuses_two(horovod):
    net, opt = _setup(horovod)
    s1 = hvd.elastic.ElasticSampler(range(16), batch_size=2)
    state = hvd.elastic.TorchState(net, opt, train_sampler=s1, epoch=0)
    assert state.train_sampler is s1 and state.sampler is s1
    s2 = hvd.elastic.ElasticSampler(range(16), batch_size=2)
    with pytest.raises(ValueError, match="one hvd.elastic.ElasticSampler"):
        hvd.elastic.TorchState(net, opt, a=s1, b=s2)
    with pytest.raises(ValueError, match="one model"):
        hvd.elastic.TorchState(net, opt, other=probe.model())


def test_run_outside_an_elastic_job_just_calls(horovod):
    state = hvd.elastic.ObjectState(n=0)

    @hvd.elastic.run
    def train(state, k):
        state.n += k
        state.commit()
        return state.n

    assert train(state, 3) == 3


def test_horovod_internal_error_becomes_a_peer_failure_in_an_elastic_job(horovod, monkeypatch):
    def train(state):
        raise hvd.HorovodInternalError("a collective failed")

    with pytest.raises(hvd.HorovodInternalError):  # outside an elastic job: unchanged
        hvd.elastic.run(train)(hvd.elastic.ObjectState())
    monkeypatch.setattr(hvd.elastic, "_lb_run", lambda f: f)  # only the facade's wrapper
    monkeypatch.setattr(world, "is_elastic", lambda: True)
    with pytest.raises(torch.distributed.DistError) as caught:
        hvd.elastic.run(train)(hvd.elastic.ObjectState())
    assert is_peer_failure(caught.value)
    assert isinstance(caught.value.__cause__, hvd.HorovodInternalError)
    assert not hvd.is_initialized(), "the negotiation of the broken world is dropped"


def test_rebuild_moves_the_reducer_and_training_matches_plain_sgd(horovod):
    net, opt = _setup(horovod)
    plain = probe.model()
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    old = opt._hvd_reducer
    opt.rebuild()
    assert opt._hvd_reducer is not old
    for seed in range(3):
        _step(net, opt, seed)
        _step(plain, ref, seed)
    for got, want in zip(_params(net), _params(plain), strict=True):
        torch.testing.assert_close(got, want)


def test_sampler_maps_horovods_record_calls():
    with pytest.raises(TypeError, match="batch_size=B"):
        hvd.elastic.ElasticSampler(range(10))
    sampler = hvd.elastic.ElasticSampler(range(10), shuffle=False, batch_size=2)
    sampler.reshard(0, 1)
    batches = list(sampler)
    assert batches[0] == [0, 1]
    sampler.record_batch(0, 2)
    sampler.record_indices([3, 2])
    assert sampler.processed_indices == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="next batch since the loader"):
        sampler.record_batch(0, 2)
    with pytest.raises(ValueError, match="batch size is 2"):
        sampler.record_batch(2, 3)
    with pytest.raises(ValueError, match="whole global steps"):
        sampler.record_indices([7])
    sampler.set_epoch(0)  # same epoch: progress kept (Horovod would clear it)
    assert sampler.processed_indices == {0, 1, 2, 3}
    sampler.load_state_dict({"epoch": 1, "processed_indices": {1, 5}})
    assert sampler.epoch == 1 and sampler.processed_indices == {1, 5}
    assert sum(len(b) for b in sampler) == 8
    sampler.set_epoch(2)
    assert sampler.processed_indices == set()


# -- end to end ---------------------------------------------------------------------------------


def _replay(history: list, samples: int) -> list[list[float]]:
    """The probe's training on exactly the recorded global batches, in one process."""
    net = probe.model(seed=0)  # rank 0's model, broadcast to all
    optimizer = torch.optim.SGD(net.parameters(), lr=probe.LR, momentum=0.9)
    _, xs, ys = probe.data(samples).tensors
    return replay_steps(net, optimizer, xs, ys, history)


def _check_ranks(root: Path, size: int) -> list:
    """Every rank's output agrees; every sample used once; parameters equal the replay."""
    results = [json.loads(path.read_text()) for path in sorted(root.glob("out.json.*"))]
    assert len(results) == size, [p.name for p in root.glob("out.json.*")]
    first = results[0]
    for other in results[1:]:
        assert other["history"] == first["history"]
        assert other["params"] == first["params"], "the ranks' parameters agree exactly"
    assert all(r["size"] == size and r["resets"] == 1 for r in results)
    used = sorted(i for _, batches in first["history"] for batch in batches for i in batch)
    assert used == list(range(SAMPLES)), "every sample exactly once over the epoch"
    assert first["processed"] == list(range(SAMPLES))
    for got, want in zip(first["params"], _replay(first["history"], SAMPLES), strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    return [w for w, _ in first["history"]]


def test_horovod_elastic_flow_survives_a_lost_node(tmp_path, monkeypatch):
    monkeypatch.setattr(_cluster, "PROBE", Path(probe.__file__))
    with _cluster.local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=tmp_path / "out.json",
        PROBE_SLEEP=0.05,
        PROBE_DIE="2@4",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        for _ in range(3):
            cluster.start()
        ends = cluster.wait()
    assert sum(1 for code, _ in ends if code == 0) == 2, ends
    worlds = _check_ranks(tmp_path, 2)
    assert worlds[:4] == [3, 3, 3, 3] and set(worlds[4:]) == {2}, worlds


def test_horovod_elastic_flow_takes_in_a_node_that_joins(tmp_path, monkeypatch):
    monkeypatch.setattr(_cluster, "PROBE", Path(probe.__file__))
    with _cluster.local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=tmp_path / "out.json",
        PROBE_WAIT_FOR_WORLD="3@5",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        cluster.start()
        cluster.start()
        cluster.wait_for_commits(3)
        cluster.start()
        ends = cluster.wait()
    assert [code for code, _ in ends] == [0, 0, 0], ends
    worlds = _check_ranks(tmp_path, 3)
    assert worlds[:5] == [2] * 5 and set(worlds[5:]) == {3}, worlds
