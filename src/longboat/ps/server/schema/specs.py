"""The specs of what an init or configure asks a server to hold: dense blocks (``block_spec``)
and sparse tables (``table_spec``), with their optimizers' hyper-parameters."""

from __future__ import annotations

from typing import Any

from longboat.ps.server.blocks import REDUCES, UPDATES
from longboat.ps.server.schema.fields import Fields, _fail, _is_number
from longboat.ps.server.tables import FLOAT_DTYPES
from longboat.ps.shared import optim

MAX_GROUPS = 1 << 16  # param groups of one optimizer


def _hparams(f: Fields, optimizer: str | None) -> dict[str, Any]:
    """The ``hparams`` of ``optimizer``: known keys, numbers >= 0 (betas below 1), flags."""
    value = f.mapping("hparams")
    if value is None or optimizer is None:
        return value or {}
    h = Fields(
        value, tuple(optim.HPARAMS[optimizer]), f.path("hparams"),
        f"{f.path('optimizer')!r} {optimizer!r}",
    )  # fmt: skip
    for key, default in optim.HPARAMS[optimizer].items():
        got = value.get(key, default)
        if isinstance(default, bool):
            h.flag(key, default)
        elif isinstance(default, list):
            if not (
                isinstance(got, list)
                and len(got) == len(default)
                and all(_is_number(v) and 0 <= v < 1 for v in got)
            ):
                h.fail(key, f"a list of {len(default)} numbers in [0, 1)", got)
        else:
            h.number(key, 0.0, lo=0.0)
    return value


def block_spec(spec: Any, where: str) -> dict[str, Any]:
    """A block spec of an init or configure: key, update, optimizer, hparams, group, reduce."""
    f = Fields(spec, ("key", "update", "optimizer", "hparams", "group", "reduce"), where)
    f.string("key", None, name=True)
    update = f.string("update", "optimizer", UPDATES)
    name = None
    if update == "optimizer" and not f.has("optimizer"):
        f.fail("optimizer", "given: update 'optimizer' needs an optimizer name", None)
    if f.has("optimizer"):
        name = f.string("optimizer", None, tuple(optim.HPARAMS))
    _hparams(f, name)
    f.integer("group", 0, hi=MAX_GROUPS - 1)
    f.string("reduce", "mean", REDUCES)
    return spec


_TABLE_FIELDS = ("name", "rows", "dim", "dtype", "optimizer", "hparams", "seed", "scale", "lazy")
_LAZY_FIELDS = ("admission", "evict_after", "expected_rows", "storage")


def table_spec(spec: Any, where: str) -> dict[str, Any]:
    """A table spec of an init (``tables.make_table`` checks what it needs on this server)."""
    if isinstance(spec, dict) and not isinstance(spec.get("lazy", False), bool):
        _fail(f"{where}.lazy", "true or false", spec["lazy"])
    lazy = isinstance(spec, dict) and spec.get("lazy") is True
    f = Fields(spec, _TABLE_FIELDS + (_LAZY_FIELDS if lazy else ()), where, "a table spec")
    f.string("name", None, name=True)
    f.flag("lazy", False)
    f.integer("rows", 0 if lazy else None, lo=0 if lazy else 1)
    f.integer("dim", None, lo=1)
    dtype = f.string("dtype", "float32", tuple(FLOAT_DTYPES))
    _hparams(f, f.string("optimizer", None, tuple(optim.ROW_STATES)))
    f.integer("seed", 0)
    f.number("scale", 0.01)
    if lazy:
        admission = f.mapping("admission") or {}
        a = Fields(admission, ("count", "probability"), f.path("admission"))
        a.integer("count", 1, lo=1)
        a.number("probability", 1.0, lo=0.0, hi=1.0, above=True)
        f.integer("evict_after", 0)
        f.integer("expected_rows", 0)
        f.string("storage", dtype, tuple(FLOAT_DTYPES))
    return spec
