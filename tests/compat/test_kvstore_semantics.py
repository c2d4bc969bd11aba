"""longboat.kvstore's corners, each as MXNet documents it: store type names, key rules and error
types, gluon.Trainer's update_on_kvstore choice and gradient scale, 2-bit gradient compression
and row-sparse values. Expectations are computed by hand or with plain tensor arithmetic;
distributed cases run 2 workers (threads) against real servers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import longboat.kvstore as kvstore
from longboat.kvstore.compression import quantize_2bit
from tests.compat.test_kvstore import _on_workers as on_dist_workers
from tests.ps._harness import servers


def _on_workers(kind: str, body: Callable[[Any], Any], n_servers: int = 1) -> list[Any]:
    """``body(store)`` on 2 workers of a ``kind`` store, in parallel threads."""
    with servers(n_servers) as (eps, token):
        return on_dist_workers(eps, token, kind, body)


# ---- store types ----------------------------------------------------------------------------
LOCAL_TYPES = ["local", "local_update_cpu", "local_allreduce_cpu", "device",
               "local_allreduce_device", "nccl"]  # fmt: skip


@pytest.mark.parametrize("name", LOCAL_TYPES)
def test_every_local_type_name_is_a_store_that_sums_device_lists(name):
    kv = kvstore.create(name)
    assert kv.type == name and (kv.rank, kv.num_workers) == (0, 1)
    kv.init(0, torch.zeros(3))
    kv.push(0, [torch.ones(3), torch.full((3,), 2.0)])
    assert torch.equal(kv.pull(0), torch.full((3,), 3.0))


def test_dist_sync_device_is_dist_device_sync_and_sums_both_workers():
    def body(kv):
        kv.init("w", torch.zeros(2, 2))
        kv.push("w", [torch.full((2, 2), kv.rank + 1.0), torch.ones(2, 2)])  # two devices
        got = torch.empty(3)
        kv.broadcast("b", torch.full((3,), kv.rank + 7.0), out=got)  # MXNet 2: rank 0's value
        return kv.type, kv.pull("w"), got

    (t0, w0, b0), (_, w1, b1) = _on_workers("dist_sync_device", body)
    assert t0 == "dist_sync_device"
    assert torch.equal(b0, torch.full((3,), 7.0)) and torch.equal(b1, b0)
    assert torch.equal(w0, torch.full((2, 2), (1 + 1) + (2 + 1.0))) and torch.equal(w0, w1)


@pytest.mark.parametrize(("name", "reason"), [("horovod", "longboat.horovod"),
                                              ("byteps", "dist_sync")])  # fmt: skip
def test_horovod_and_byteps_are_refused_with_the_reason(name, reason):
    with pytest.raises(kvstore.MXNetError, match=reason) as info:
        kvstore.create(name)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="unknown KVStore type"):
        kvstore.create("dist_sink")  # MXNet would make a dist_sync store of a typo: refused


# ---- keys and errors ------------------------------------------------------------------------
def test_mxnet_error_is_a_runtime_error_and_key_errors_are_both():
    assert issubclass(kvstore.MXNetError, RuntimeError)
    kv = kvstore.create("local")
    with pytest.raises(kvstore.MXNetError, match="has not been inited") as info:
        kv.pull(4)
    assert isinstance(info.value, KeyError)
    with pytest.raises(KeyError):
        kv.push(4, torch.zeros(1))
    with pytest.raises(kvstore.MXNetError, match="checkpoint directory") as refused:
        kv.save_optimizer_states("states.bin")
    assert isinstance(refused.value, NotImplementedError)


def test_one_key_type_per_store_and_each_key_initialised_once():
    kv = kvstore.create("local")
    kv.init(3, torch.zeros(2))
    with pytest.raises(kvstore.MXNetError, match="Mixed key types are not allowed"):
        kv.init("a", torch.zeros(2))
    with pytest.raises(kvstore.MXNetError, match="Mixed key types are not allowed"):
        kv.pull("3")  # not the int key 3
    with pytest.raises(AssertionError, match="inconsistent types of keys"):
        kv.init([5, "b"], [torch.zeros(1), torch.zeros(1)])
    with pytest.raises(kvstore.MXNetError, match="duplicate init of key 3"):
        kv.init(3, torch.ones(2))
    with pytest.raises(kvstore.MXNetError, match="duplicate init of key 6"):
        kv.init([6, 6], [torch.zeros(1), torch.zeros(1)])
    assert torch.equal(kv.pull(3), torch.zeros(2))  # the failed inits changed nothing
    s = kvstore.create("local")
    s.init(["x", "y"], [torch.zeros(2), torch.zeros(2)])
    s.push(["x", "y", "x"], [torch.ones(2), torch.ones(2), torch.full((2,), 4.0)])
    x, y, x_again = s.pull(["x", "y", "x"])  # a key listed twice: its values are summed
    assert torch.equal(x, torch.full((2,), 5.0)) and torch.equal(x_again, x)
    assert torch.equal(y, torch.ones(2))


# ---- gluon.Trainer: update_on_kvstore and the gradient scale --------------------------------
def test_update_on_kvstore_none_follows_gluons_rule(monkeypatch):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert kvstore.Trainer(model.parameters(), opt, kvstore.create("local")).update_on_kvstore
    assert not kvstore.Trainer(model.parameters(), opt, "device").update_on_kvstore  # no store
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "0")
    assert not kvstore.Trainer(model.parameters(), opt, kvstore.create("local")).update_on_kvstore
    assert kvstore.Trainer(model.parameters(), opt, kvstore.create("local"), True).update_on_kvstore


def test_dist_async_trainer_updates_on_kvstore_and_refuses_false():
    def body(kv):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError) as info:
            kvstore.Trainer(model.parameters(), opt, kv, update_on_kvstore=False)
        auto = kvstore.Trainer(model.parameters(), opt, kv)  # None: async means on the store
        return str(info.value), auto.update_on_kvstore

    for message, auto in _on_workers("dist_async", body):
        assert message == "Please set update_on_kvstore=True when training in async mode."
        assert auto is True


def _batches(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(4, 3, generator=g), torch.randn(4, generator=g)


@pytest.mark.parametrize("update_on_kvstore", [True, False, None])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_trainer_step_applies_scale_over_batch_size_once_to_the_workers_sum(
    update_on_kvstore, scale
):
    """gluon: w -= lr * (scale / batch_size) * (sum of every worker's gradient); batch_size
    may change between steps."""
    w_start = torch.tensor([[0.5, -1.0, 2.0]])
    lr, sizes = 0.1, (5, 8)

    def body(kv):
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(float(kv.rank))  # worker 0's start must win
            if kv.rank == 0:
                model.weight.copy_(w_start)
        opt = (torch.optim.SGD(model.parameters(), lr=lr) if scale is None
               else kvstore.optimizer.SGD(learning_rate=lr, rescale_grad=scale))  # fmt: skip
        trainer = kvstore.Trainer(model.parameters(), opt, kv, update_on_kvstore)
        x, y = _batches(kv.rank)
        for size in sizes:
            trainer.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).sum().backward()
            trainer.step(size)
        return trainer.update_on_kvstore, model.weight.detach().clone()

    results = _on_workers("dist_sync", body)
    w = w_start.clone()
    for size in sizes:  # d/dw sum((x w^T - y)^2) = 2 (x w^T - y)^T x, summed over workers
        total = torch.zeros_like(w)
        for rank in range(2):
            x, y = _batches(rank)
            total += 2 * ((x @ w.T).squeeze(1) - y) @ x
        w = w - lr * ((1.0 if scale is None else scale) / size) * total
    for on_kvstore, weight in results:
        assert on_kvstore is (update_on_kvstore is not False)  # None: dist_sync means True
        torch.testing.assert_close(weight, w, rtol=1e-5, atol=1e-6)


def test_allreduce_grads_and_update_are_for_local_updates_only_and_stale_grads_refused():
    model = torch.nn.Linear(2, 1)
    trainer = kvstore.Trainer(model.parameters(), torch.optim.SGD(model.parameters(), lr=1.0),
                              kvstore.create("local"), update_on_kvstore=True)  # fmt: skip
    with pytest.raises(UserWarning, match=r"parameter\(s\) \[0, 1\] has not been computed"):
        trainer.step(1)  # gluon: no backward since the last step
    with pytest.raises(UserWarning, match="ignore_stale_grad=True .* not supported"):
        trainer.step(1, ignore_stale_grad=True)
    with pytest.raises(ValueError, match="update_on_kvstore"):
        trainer.allreduce_grads()
    with pytest.raises(ValueError, match="update_on_kvstore"):
        trainer.update(1)


def _two_trainers(first_mode: bool | None, second_mode: bool, kind: str = "dist_sync"):
    """A body: on a store with 2-bit compression, a Trainer (``first_mode``; None: none)
    trains 2 steps, then a second Trainer for another model (momentum SGD) is made on the same
    store and trains 2 steps. Returns the second model's weight after construction and after
    training."""

    def body(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.05})
        if first_mode is not None:
            first = torch.nn.Linear(3, 1, bias=False)
            opt = torch.optim.SGD(first.parameters(), lr=0.3, momentum=0.9)
            trainer = kvstore.Trainer(first.parameters(), opt, kv, first_mode)
            for size in (4, 4):
                trainer.zero_grad()
                x, y = _batches(kv.rank + 5)
                ((first(x).squeeze(1) - y) ** 2).sum().backward()
                trainer.step(size)
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]) * (kv.rank + 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = kvstore.Trainer(model.parameters(), opt, kv, second_mode)
        start = model.weight.detach().clone()
        if kind == "dist_async":
            return start, None
        x, y = _batches(kv.rank)
        for size in (5, 8):
            trainer.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).sum().backward()
            trainer.step(size)
        return start, model.weight.detach().clone()

    return body


@pytest.mark.parametrize(
    ("first_mode", "second_mode"), [(True, True), (False, False), (True, False), (False, True)]
)
def test_a_second_trainer_on_a_dist_store_starts_as_on_a_fresh_store(first_mode, second_mode):
    """gluon keys every Trainer's parameters 0..n-1: MXNet's dist store accepts their init
    again. The second Trainer gets its worker 0's values and fresh optimizer state, whatever
    the first left on the store (weights, summed gradients, an optimizer, residuals)."""
    fresh = _on_workers("dist_sync", _two_trainers(None, second_mode))
    again = _on_workers("dist_sync", _two_trainers(first_mode, second_mode))
    worker0_start = torch.tensor([[0.5, -1.0, 2.0]])
    for (start, trained), (fresh_start, fresh_trained) in zip(again, fresh, strict=True):
        assert torch.equal(start, worker0_start) and torch.equal(fresh_start, worker0_start)
        torch.testing.assert_close(trained, fresh_trained, rtol=1e-6, atol=1e-7)


def test_a_second_trainer_on_a_dist_async_store_gets_worker_0s_values():
    for start, _ in _on_workers("dist_async", _two_trainers(True, True, "dist_async")):
        assert torch.equal(start, torch.tensor([[0.5, -1.0, 2.0]]))


def test_dist_stores_accept_int_keys_again_keeping_the_value_and_refuse_str_keys():
    """MXNet's dist store has no duplicate check for int keys (its local store and string keys
    have one); the stored value stays and every worker still meets at the barrier."""

    def ints(kv):
        kv.init(0, torch.zeros(2))
        kv.push(0, torch.ones(2))
        kv.init([0, 1], [torch.full((2,), 9.0), torch.full((3,), kv.rank + 4.0)])
        with pytest.raises(kvstore.InvalidArgumentError) as bad_shape:
            kv.init(0, torch.zeros(3))
        with pytest.raises(kvstore.MXNetError, match="duplicate init of key 1"):
            kv.init([1, 1], [torch.zeros(3), torch.zeros(3)])
        return kv.pull(0), kv.pull(1), str(bad_shape.value)

    def strs(kv):
        kv.init("w", torch.zeros(2))
        with pytest.raises(kvstore.InvalidArgumentError, match="duplicate init of key 'w'"):
            kv.init("w", torch.ones(2))
        return kv.pull("w")

    for zero, one, bad_shape in _on_workers("dist_sync", ints):
        assert torch.equal(zero, torch.full((2,), 2.0))  # the pushes' sum, not 9
        assert torch.equal(one, torch.full((3,), 4.0))  # a new key: worker 0's value
        assert bad_shape == "init 0: the value has shape (3,), the key holds (2,)"
    for w in _on_workers("dist_sync", strs):
        assert torch.equal(w, torch.zeros(2))
    local = kvstore.create("local")
    model = torch.nn.Linear(2, 1)
    kvstore.Trainer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), local)
    with pytest.raises(kvstore.InvalidArgumentError, match="duplicate init of key 0"):
        kvstore.Trainer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), local)


# ---- 2-bit gradient compression ---------------------------------------------------------------
T = 0.5
PUSHES = {  # worker: its two gradients
    0: [torch.tensor([0.25, -0.75, 1.5, 0.0]), torch.tensor([0.25, 0.0, -0.25, -0.5])],
    1: [torch.tensor([-0.5, 0.5, 0.25, 2.0]), torch.tensor([0.0, 0.0, 0.25, 0.0])],
}
# By hand (a = residual + g; q = +-0.5 where |a| >= 0.5, else 0; residual = a - q):
#   worker 0: a1 = [.25 -.75 1.5 0]   q1 = [0 -.5 .5 0]    r1 = [.25 -.25 1 0]
#             a2 = [.5 -.25 .75 -.5]  q2 = [.5 0 .5 -.5]   r2 = [0 -.25 .25 0]
#   worker 1: a1 = [-.5 .5 .25 2]     q1 = [-.5 .5 0 .5]   r1 = [0 0 .25 1.5]
#             a2 = [0 0 .5 1.5]       q2 = [0 0 .5 .5]     r2 = [0 0 0 1]
SUMS = [torch.tensor([-0.5, 0.0, 0.5, 0.5]), torch.tensor([0.5, 0.0, 1.0, 0.0])]


def test_quantize_2bit_and_its_residual_by_hand():
    q1, r1 = quantize_2bit(PUSHES[0][0], torch.zeros(4), T)
    assert torch.equal(q1, torch.tensor([0.0, -0.5, 0.5, 0.0]))
    assert torch.equal(r1, torch.tensor([0.25, -0.25, 1.0, 0.0]))
    q2, r2 = quantize_2bit(PUSHES[0][1], r1, T)
    assert torch.equal(q2, torch.tensor([0.5, 0.0, 0.5, -0.5]))
    assert torch.equal(r2, torch.tensor([0.0, -0.25, 0.25, 0.0]))


def test_dist_sync_compresses_each_workers_push_with_its_residual():
    def body(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": T})
        kv.init(0, torch.zeros(4))
        seen = []
        for g in PUSHES[kv.rank]:
            kv.push(0, g)
            seen.append(kv.pull(0))  # no optimizer: the value is the step's sum
        return seen

    for seen in _on_workers("dist_sync", body):
        assert torch.equal(seen[0], SUMS[0]) and torch.equal(seen[1], SUMS[1])


def test_compressed_gradients_feed_the_servers_optimizer():
    def body(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": T})
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0, rescale_grad=0.5))
        kv.init(0, torch.ones(4))
        for g in PUSHES[kv.rank]:
            kv.push(0, g)
        return kv.pull(0)

    for w in _on_workers("dist_sync", body):  # the scale applies to the dequantized sum
        assert torch.equal(w, torch.ones(4) - 0.5 * (SUMS[0] + SUMS[1]))


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_compression_params_quantize_each_workers_gradient(update_on_kvstore):
    def body(kv):
        weight = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.SGD([weight], lr=0.5)
        trainer = kvstore.Trainer([weight], opt, kv, update_on_kvstore,
                                  compression_params={"type": "2bit", "threshold": T})  # fmt: skip
        for g in PUSHES[kv.rank]:
            trainer.zero_grad()
            (weight * g).sum().backward()  # the gradient is g
            trainer.step(2)
        return weight.detach()

    for w in _on_workers("dist_sync", body):  # lr * (1 / batch_size) * the quantized sums
        assert torch.equal(w, -0.5 * 0.5 * (SUMS[0] + SUMS[1]))


def test_device_store_compresses_each_device_and_local_types_refuse():
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": T})
    kv.init(0, torch.zeros(4))
    for step in range(2):  # two "devices", each with its own residual
        kv.push(0, [PUSHES[0][step], PUSHES[1][step]])
        assert torch.equal(kv.pull(0), SUMS[step])
    for name in ("local", "local_update_cpu", "local_allreduce_cpu", "nccl"):
        with pytest.raises(kvstore.MXNetError, match="not supported for this type of kvstore"):
            kvstore.create(name).set_gradient_compression({"type": "2bit", "threshold": T})
    with pytest.raises(ValueError, match="MXNet's '2bit' and '1bit' are"):
        kv.set_gradient_compression({"type": "3bit"})
    with pytest.raises(ValueError, match="2bit compression needs a threshold > 0"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0})
    with pytest.raises(ValueError, match="1bit compression needs a threshold >= 0"):
        kv.set_gradient_compression({"type": "1bit", "threshold": -1})


def test_one_bit_sends_signs_with_error_feedback():
    """MXNet's 1bit: q = +1 where r + g > threshold, else -1; the rest is carried over."""
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "1bit", "threshold": 0.25})
    kv.init(0, torch.zeros(3))
    g = torch.tensor([0.5, 0.1, -2.0])
    kv.push(0, [g])  # a = g: [+1, -1, -1], residual [-0.5, 1.1, -1.0]
    assert torch.equal(kv.pull(0), torch.tensor([1.0, -1.0, -1.0]))
    kv.push(0, [g])  # a = [0.0, 1.2, -3.0]: [-1, +1, -1]
    assert torch.equal(kv.pull(0), torch.tensor([-1.0, 1.0, -1.0]))
    # two devices, one residual each: device 0 has [1.0, 0.2, -2.0] left, so a = [1.5, 0.3,
    # -4.0] -> [+1, +1, -1]; device 1 starts from zero -> [+1, -1, -1]; the sum travels
    kv.push(0, [g, g])
    assert torch.equal(kv.pull(0), torch.tensor([2.0, 0.0, -2.0]))


# ---- row-sparse values ----------------------------------------------------------------------
def test_row_sparse_pull_returns_sorted_unique_rows_for_each_output():
    kv = kvstore.create("local")
    value = torch.arange(12.0).reshape(6, 2)
    kv.init("emb", kvstore.RowSparse.from_dense(value))  # row 0 is zero: not stored, still 0
    outs = [kvstore.RowSparse.zeros((6, 2)), kvstore.RowSparse.zeros((6, 2))]
    kv.row_sparse_pull("emb", out=outs, row_ids=torch.tensor([4, 1, 4]))  # one ids: every out
    for o in outs:
        assert o.indices.tolist() == [1, 4] and torch.equal(o.data, value[[1, 4]])
        assert torch.equal(o.to_dense()[[1, 4]], value[[1, 4]]) and o.to_dense()[0].eq(0).all()
    kv.row_sparse_pull("emb", out=outs, row_ids=[torch.tensor([0]), torch.tensor([5, 2])])
    assert outs[0].indices.tolist() == [0] and outs[1].indices.tolist() == [2, 5]
    skipped = kvstore.RowSparse.zeros((6, 2))
    kv.pull("emb", out=skipped)  # ignore_sparse=True (MXNet's default): left alone
    assert len(skipped.indices) == 0
    kv.pull("emb", out=skipped, ignore_sparse=False)
    assert torch.equal(skipped.to_dense(), value)
    with pytest.raises(ValueError, match="row id 6"):
        kv.row_sparse_pull("emb", out=skipped, row_ids=torch.tensor([6]))
    floats = kvstore.RowSparse.zeros((6, 2))  # MXNet's arrays are float32: it casts row ids
    kv.row_sparse_pull("emb", out=floats, row_ids=torch.tensor([4.0, 1.0, 4.0]))
    assert floats.indices.tolist() == [1, 4] and torch.equal(floats.data, value[[1, 4]])


def test_refused_row_sparse_pulls_raise_invalid_argument_error_saying_what_was_wrong():
    kv = kvstore.create("local")
    kv.init(["emb", "w"], [torch.ones(6, 2), torch.ones(3, 2)])
    rows = kvstore.RowSparse.zeros((6, 2))
    ids = torch.tensor([1, 4])
    refusals = {
        "out must be a RowSparse (MXNet's row_sparse storage), got Tensor": lambda: (
            kv.row_sparse_pull("emb", out=torch.zeros(6, 2), row_ids=ids)
        ),
        "row_ids must be whole row numbers; float32 value 4.5 is not one": lambda: (
            kv.row_sparse_pull("emb", out=rows, row_ids=torch.tensor([1.0, 4.5]))
        ),
        "row_ids must be row numbers, got dtype bool": lambda: kv.row_sparse_pull(
            "emb", out=rows, row_ids=torch.tensor([True, False])
        ),
        "needs a list of outputs, one per key; got one RowSparse": lambda: kv.row_sparse_pull(
            ["emb", "w"], out=rows, row_ids=[ids, ids]
        ),
        "row_sparse_pull of 2 keys needs a list of row_ids, one per key": lambda: (
            kv.row_sparse_pull(
                ["emb", "w"],
                out=[rows, kvstore.RowSparse.zeros((3, 2))],
                row_ids=torch.tensor([0, 1]),
            )  # fmt: skip
        ),
        "row_sparse_pull: 2 keys but 1 output": lambda: kv.row_sparse_pull(
            ["emb", "w"], out=[rows], row_ids=[ids, ids]
        ),
    }
    for message, call in refusals.items():
        with pytest.raises(kvstore.InvalidArgumentError) as info:
            call()
        assert message in str(info.value)
        assert isinstance(info.value, kvstore.MXNetError) and isinstance(info.value, ValueError)
    assert len(rows.indices) == 0  # nothing was filled by a refused call


def test_row_sparse_pushes_sum_per_row_across_workers():
    def body(kv):
        kv.init("emb", torch.zeros(6, 2))
        rows, data = ([0, 3], [[1.0, 1.0], [2.0, 2.0]]) if kv.rank == 0 else \
            ([3, 5], [[10.0, 10.0], [20.0, 20.0]])  # fmt: skip
        kv.push("emb", kvstore.row_sparse_array((data, rows), shape=(6, 2)))
        out = kvstore.RowSparse.zeros((6, 2))
        kv.row_sparse_pull("emb", out=out, row_ids=torch.tensor([5, 3, 5, 1]))
        return out

    for out in _on_workers("dist_sync", body):
        assert out.indices.tolist() == [1, 3, 5]
        assert torch.equal(out.data, torch.tensor([[0.0, 0.0], [12.0, 12.0], [20.0, 20.0]]))


def test_row_sparse_gradients_update_only_their_rows_or_are_refused():
    start = torch.ones(4, 2)

    def body(kv):
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
        kv.init(0, start)
        grad = kvstore.row_sparse_array(([[1.0, 2.0]], [kv.rank + 1]), shape=(4, 2))
        kv.push(0, grad)
        return kv.pull(0)

    expected = start.clone()
    expected[1] -= 0.1 * torch.tensor([1.0, 2.0])
    expected[2] -= 0.1 * torch.tensor([1.0, 2.0])
    for w in _on_workers("dist_sync", body):
        assert torch.equal(w, expected)
    kv = kvstore.create("local")
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.init(0, start)
    with pytest.raises(ValueError, match="lazy update"):
        kv.push(0, kvstore.RowSparse.from_dense(torch.eye(4, 2)))
