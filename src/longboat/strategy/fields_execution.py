"""The ExecutionStrategy group of the Strategy's field table (Paddle's executor settings), in
table order."""

from __future__ import annotations

from longboat.strategy.spec import FieldSpec, mapped, not_applicable
from longboat.strategy.values import Bool, Int

EXECUTION_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "num_threads",
        Int(1),
        1,
        "CPU threads for intra-op parallelism",
        mapped("torch.set_num_threads"),
        group="ExecutionStrategy",
        per_rank=True,
    ),
    FieldSpec(
        "num_iteration_per_drop_scope",
        Int(1),
        10,
        "iterations between two drops of the local scope of temporaries",
        not_applicable(
            "PyTorch frees temporaries as soon as they are unreferenced, so there is no scope "
            "to drop; remove this setting"
        ),
        group="ExecutionStrategy",
        paddle_defaults=(100,),  # a Paddle ExecutionStrategy object's default
    ),
    FieldSpec(
        "num_iteration_per_run",
        Int(1),
        3,
        "iterations an executor runs per call",
        not_applicable(
            "longboat has no executor: your own loop runs one iteration per optimizer step; "
            "remove this setting and loop in your training code"
        ),
        group="ExecutionStrategy",
        paddle_defaults=(1,),  # Paddle's default: one iteration per run, as a PyTorch loop
    ),
    FieldSpec(
        "use_thread_barrier",
        Bool(),
        False,
        "trainer threads wait on a barrier (parameter-server mode)",
        mapped("a per-step barrier of all trainers on the servers (half-async mode)"),
        group="ExecutionStrategy",
    ),
)
