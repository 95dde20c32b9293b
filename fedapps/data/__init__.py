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
    GROUP_TRANSFORM_PARTITIONS,
    PARTITIONS,
    client_groups,
    group_classes,
    partition_cosmos_groups,
    partition_dirichlet,
    partition_groups_iid,
    partition_iid,
    partition_pathological,
    stratified_split,
)
from .sources import SOURCES, Dataset, load_source, source_info
from .transforms import (
    ROTATION_GROUPS,
    label_swap_permutations,
    public_group_shares,
    rotate_images,
    rotation_quarter_turns,
    swap_choices,
)

__all__ = [
    "DataError",
    "SOURCES",
    "PARTITIONS",
    "GROUP_TRANSFORM_PARTITIONS",
    "ROTATION_GROUPS",
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
    "partition_groups_iid",
    "client_groups",
    "group_classes",
    "rotation_quarter_turns",
    "rotate_images",
    "label_swap_permutations",
    "swap_choices",
    "public_group_shares",
    "stratified_split",
    "build_federation",
    "check_spec",
    "get_federation",
    "spec_key",
    "clear_federation_cache",
]
