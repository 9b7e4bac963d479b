"""MapBatchesValidator: a validate_fn that scores a checkpoint with Ray Data ``map_batches``,
and how validation datasets travel inside a pickled validate_fn (``portable_dataset``).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import cloudpickle
import numpy as np

from validation_service.errors import InvalidInput, PermanentValidationError

if TYPE_CHECKING:
    import ray.data
    from ray.data.aggregate import AggregateFn
    from ray.train import Checkpoint

__all__ = ["MapBatchesValidator"]

# A Dataset, or a zero-argument function that builds one where the validation runs.
DatasetSource: TypeAlias = "ray.data.Dataset | Callable[[], ray.data.Dataset]"
Aggregate: TypeAlias = (
    "Callable[[ray.data.Dataset], dict[str, Any]] | Mapping[str, AggregateFn] | None"
)

# In-memory datasets are embedded in every stored job (one per checkpoint): keep them small.
MAX_EMBEDDED_DATASET_BYTES = 32 * 1024 * 1024
_CORRECT_COLUMN = "correct"


@dataclasses.dataclass
class MapBatchesValidator:
    """Validates a checkpoint with ``dataset.map_batches(predictor_cls, ...)`` (Ray's guide).

    ``predictor_cls(checkpoint=..., **fn_constructor_kwargs, **validate_config)`` is built
    once per map_batches actor and called on batches. Its output is reduced to metrics:

    - ``aggregate=None``: every numeric 1-D column is averaged; a 0/1 column ``"correct"``
      becomes ``"accuracy"``, any other column (``"loss"``) keeps its name;
    - ``aggregate={"accuracy": Mean("correct"), "n": Count()}``: those
      ``ray.data.aggregate`` functions, computed with ``Dataset.aggregate``;
    - ``aggregate=callable``: ``aggregate(output_dataset) -> dict``.

    ``dataset`` is a ``ray.data.Dataset`` or a zero-argument function returning one (called
    where the validation runs). The validator is pickled when the checkpoint is reported
    and runs later, in another process: a lazy dataset (``ray.data.read_parquet(...)``)
    travels as its plan and is read at validation time; an in-memory one
    (``from_items``, ``from_numpy``, ``materialize()``) is copied into the pickle up to
    32 MiB, because its blocks belong to the reporting process. Larger data: read it
    from storage or pass a function.

    ``batch_size``, ``concurrency`` (an actor pool size, or ``(min, max)``), ``num_cpus``,
    ``num_gpus`` and ``accelerator_type`` are those of each map_batches actor. The Ray task
    that calls the validator only waits for them: report it with
    ``validation_resources=validator.recommended_resources`` (no CPU), so that waiting
    tasks cannot hold the CPUs their actors need.
    """

    predictor_cls: type
    dataset: DatasetSource
    _: dataclasses.KW_ONLY
    batch_size: int | None = 128
    concurrency: int | tuple[int, int] = 1
    num_cpus: float | None = None
    num_gpus: float = 0
    accelerator_type: str | None = None
    aggregate: Aggregate = None
    fn_constructor_kwargs: dict[str, Any] | None = None
    batch_format: str = "numpy"

    def __post_init__(self) -> None:
        if not isinstance(self.predictor_cls, type) or not callable(self.predictor_cls):
            raise InvalidInput(
                f"predictor_cls must be a callable class (its __init__ takes checkpoint=, "
                f"its __call__ takes a batch), got {self.predictor_cls!r}."
            )
        check_dataset_source(self.dataset, "dataset")
        if self.aggregate is not None and not callable(self.aggregate):
            if not isinstance(self.aggregate, Mapping) or not self.aggregate:
                raise InvalidInput(
                    "aggregate must be None, a function (output Dataset) -> dict, or a "
                    "non-empty dict of metric name -> ray.data.aggregate function, got "
                    f"{self.aggregate!r}."
                )
            names = [getattr(agg, "name", None) for agg in self.aggregate.values()]
            if None in names or len(set(names)) != len(names):
                raise InvalidInput(
                    f"aggregate values must be ray.data.aggregate functions with distinct "
                    f"names, got {names}; pass alias_name= to tell equal ones apart."
                )
        _actor_pool(self.concurrency)  # fails now, not at validation time

    @property
    def recommended_resources(self) -> dict[str, Any]:
        """validation_resources for report(): the calling task needs no CPU of its own."""
        resources: dict[str, Any] = {"num_cpus": 0}
        if self.accelerator_type:
            resources["accelerator_type"] = self.accelerator_type
        return resources

    def __call__(self, checkpoint: Checkpoint, config: dict[str, Any]) -> dict[str, Any]:
        constructor_kwargs = {
            "checkpoint": checkpoint,
            **(self.fn_constructor_kwargs or {}),
            **(config or {}),
        }
        _check_constructor_accepts(self.predictor_cls, constructor_kwargs)
        options = actor_resources(self.num_cpus, self.num_gpus, self.accelerator_type)
        output = resolve_dataset(self.dataset, "dataset").map_batches(
            self.predictor_cls,
            fn_constructor_kwargs=constructor_kwargs,
            batch_size=self.batch_size,
            batch_format=self.batch_format,
            compute=_actor_pool(self.concurrency),
            **options,
        )
        if self.aggregate is None:
            return mean_of_numeric_columns(output)
        if callable(self.aggregate):
            return self.aggregate(output)
        result = output.aggregate(*self.aggregate.values())
        return {key: _plain(result[agg.name]) for key, agg in self.aggregate.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "dataset": portable_dataset(self.dataset, "dataset")}


def mean_of_numeric_columns(output: ray.data.Dataset) -> dict[str, float]:
    """The default reduction: the mean of each numeric column, "correct" as "accuracy".

    Streams the output once and sums in float64, so the accuracy is exact.
    """
    sums: dict[str, float] = {}
    rows = 0
    for batch in output.iter_batches(batch_size=None, batch_format="numpy"):
        numeric = {
            name: column
            for name, column in batch.items()
            if isinstance(column, np.ndarray) and column.ndim == 1 and column.dtype.kind in "biuf"
        }
        if not numeric:
            raise PermanentValidationError(
                f"the predictor returned a batch with columns {sorted(batch)} and none is a "
                "numeric 1-D column; return e.g. {'correct': (pred == label)} (one 0/1 per "
                "row) or pass aggregate= to reduce the output yourself."
            )
        batch_rows = len(next(iter(numeric.values())))
        rows += batch_rows
        for name, column in numeric.items():
            sums[name] = sums.get(name, 0.0) + float(column.sum(dtype=np.float64))
    if rows == 0:
        raise PermanentValidationError(
            "map_batches produced no rows: the validation dataset is empty."
        )
    return {
        ("accuracy" if name == _CORRECT_COLUMN else name): total / rows
        for name, total in sums.items()
    }


# ------------------------------------------------------------------ datasets in a pickle


def check_dataset_source(source: Any, what: str) -> None:
    import ray.data

    if not isinstance(source, ray.data.Dataset) and not callable(source):
        raise InvalidInput(
            f"{what} must be a ray.data.Dataset or a zero-argument function returning one, "
            f"got {type(source).__name__}."
        )


def resolve_dataset(source: DatasetSource, what: str) -> ray.data.Dataset:
    """The Dataset itself, or what the zero-argument function builds."""
    import ray.data

    dataset = source if isinstance(source, ray.data.Dataset) else source()
    if not isinstance(dataset, ray.data.Dataset):
        raise PermanentValidationError(
            f"{what}: the function {source!r} returned {type(dataset).__name__}, "
            "not a ray.data.Dataset."
        )
    return dataset


def portable_dataset(source: DatasetSource, what: str) -> DatasetSource:
    """What to pickle for a dataset so that another process, later, can read it.

    A Dataset whose plan holds object refs (in-memory blocks owned by this process)
    would be unreadable once unpickled elsewhere: it is replaced by a copy of its rows.
    """
    import ray
    import ray.data

    if not isinstance(source, ray.data.Dataset) or not _holds_object_refs(source):
        return source
    tables = [ray.get(ref) for ref in source.to_arrow_refs()]
    size = sum(table.nbytes for table in tables)
    if size > MAX_EMBEDDED_DATASET_BYTES:
        raise InvalidInput(
            f"{what} is an in-memory Dataset of {size / 2**20:.0f} MiB; its blocks live in "
            "this process and would be copied into every stored validation job (limit "
            f"{MAX_EMBEDDED_DATASET_BYTES // 2**20} MiB). Read it from storage "
            "(ray.data.read_parquet(...)) or pass a zero-argument function that builds it."
        )
    return ArrowTablesDataset(tables)


@dataclasses.dataclass
class ArrowTablesDataset:
    """A zero-argument dataset source holding a copy of an in-memory Dataset's rows."""

    tables: list[Any]

    def __call__(self) -> ray.data.Dataset:
        import ray.data

        return ray.data.from_arrow(self.tables)


def _holds_object_refs(obj: Any) -> bool:
    import ray

    found = False

    class _Probe(cloudpickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            nonlocal found
            if isinstance(value, ray.ObjectRef):
                found = True
                return (type(None), ())
            return super().reducer_override(value)

    _Probe(io.BytesIO()).dump(obj)
    return found


def _check_constructor_accepts(predictor_cls: type, kwargs: dict[str, Any]) -> None:
    # Fails here, once and for good, rather than in every map_batches actor.
    try:
        inspect.signature(predictor_cls).bind(**kwargs)
    except TypeError as exc:
        raise PermanentValidationError(
            f"{predictor_cls.__qualname__}(**{sorted(kwargs)}) does not bind ({exc}). Its "
            "__init__ gets checkpoint=, fn_constructor_kwargs and the validate_config "
            "entries; accept them (or **kwargs) or report without those validate_config keys."
        ) from None


def actor_resources(num_cpus, num_gpus, accelerator_type) -> dict[str, Any]:
    """map_batches' resource options of each predictor actor, only those that were set."""
    options: dict[str, Any] = {}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    if num_gpus:
        options["num_gpus"] = num_gpus
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    return options


def _actor_pool(concurrency: int | tuple[int, ...]):
    from ray.data import ActorPoolStrategy

    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return ActorPoolStrategy(size=concurrency)
    if (
        isinstance(concurrency, tuple)
        and len(concurrency) in (2, 3)
        and all(isinstance(n, int) and n >= 1 for n in concurrency)
    ):
        return ActorPoolStrategy(
            min_size=concurrency[0],
            max_size=concurrency[1],
            initial_size=concurrency[2] if len(concurrency) == 3 else None,
        )
    raise InvalidInput(
        f"concurrency must be an actor count >= 1 or a (min, max) tuple, got {concurrency!r}."
    )


def _plain(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", 0) == 0 else value
