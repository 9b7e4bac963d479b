"""The import path of MapBatchesValidator named by the design (it lives in validators/)."""

from validation_service.validators.map_batches import (
    ArrowTablesDataset,
    DatasetSource,
    MapBatchesValidator,
    check_dataset_source,
    mean_of_numeric_columns,
    portable_dataset,
    resolve_dataset,
)

__all__ = [
    "ArrowTablesDataset",
    "DatasetSource",
    "MapBatchesValidator",
    "check_dataset_source",
    "mean_of_numeric_columns",
    "portable_dataset",
    "resolve_dataset",
]
