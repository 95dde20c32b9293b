"""Model zoo: the papers' CNN / MLP and small-image torchvision variants, behind one registry."""

from .zoo import (
    MODEL_NAMES,
    STATE_PARTS,
    ModelError,
    build_model,
    check_model_names,
    classifier_name,
    count_parameters,
    seeded,
    state_part,
    top_level_children,
)

__all__ = [
    "MODEL_NAMES",
    "STATE_PARTS",
    "ModelError",
    "build_model",
    "check_model_names",
    "classifier_name",
    "count_parameters",
    "seeded",
    "state_part",
    "top_level_children",
]
