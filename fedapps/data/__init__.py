"""Data layer: sources, partitioners, the public set U and per-client data (see DESIGN.md, "Data")."""

from .errors import DataError
from .federation import (
    SPEC_KEYS,
    ClientData,
    Federation,
    build_federation,
    check_spec,
    clear_federation_cache,
    get_federation,
    spec_key,
)
from .partition import (
    PARTITIONS,
    group_classes,
    partition_cosmos_groups,
    partition_dirichlet,
    partition_iid,
    partition_pathological,
    stratified_split,
)
from .sources import SOURCES, Dataset, load_source, source_info

__all__ = [
    "DataError",
    "SOURCES",
    "PARTITIONS",
    "SPEC_KEYS",
    "Dataset",
    "ClientData",
    "Federation",
    "source_info",
    "load_source",
    "partition_iid",
    "partition_pathological",
    "partition_dirichlet",
    "partition_cosmos_groups",
    "group_classes",
    "stratified_split",
    "build_federation",
    "check_spec",
    "get_federation",
    "spec_key",
    "clear_federation_cache",
]
