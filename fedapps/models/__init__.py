"""Model zoo: the papers' CNN / MLP and small-image torchvision variants, behind one registry; or the user's own model,
named ``package.module:factory``."""

from .zoo import (
    MODEL_NAMES,
    STATE_PARTS,
    ModelError,
    build_model,
    check_model_names,
    check_user_model,
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
    "check_user_model",
    "classifier_name",
    "count_parameters",
    "seeded",
    "state_part",
    "top_level_children",
]
