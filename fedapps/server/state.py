"""An algorithm's state as data, for the checkpoint (:mod:`fedapps.checkpoint` holds no objects): every instance
attribute of a strategy but the ones it names not state (:func:`state_of`), restored onto a strategy built from the
same config (:func:`restore_state`)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def state_of(obj: object, excluded: frozenset[str]) -> dict[str, Any]:
    """``obj``'s instance attributes not in ``excluded``, as data (tensors moved to the CPU; torch modules refused)."""
    return {k: state_value(v, f"{type(obj).__name__}.{k}") for k, v in vars(obj).items() if k not in excluded}


def restore_state(obj: object, state: Mapping[str, Any], excluded: frozenset[str]) -> None:
    """Set what :func:`state_of` returned back onto ``obj`` (built from the same config)."""
    for k, v in state.items():
        if k in excluded:
            continue
        current = getattr(obj, k, None)
        if isinstance(current, np.random.Generator) and isinstance(v, dict) and GENERATOR_STATE in v:
            current.bit_generator.state = v[GENERATOR_STATE]  # the same kind of generator: built from the config
        elif isinstance(v, dict) and DATACLASS_STATE in v:
            if not (dataclasses.is_dataclass(current) and not isinstance(current, type)):
                raise ValueError(
                    f"{type(obj).__name__}.{k}: the checkpoint holds the fields of a {v.get('class')}, but this "
                    f"config built {type(current).__name__}: resume with the run's own config"
                )
            setattr(obj, k, dataclasses.replace(current, **v[DATACLASS_STATE]))  # the config's own class
        else:
            setattr(obj, k, v)


GENERATOR_STATE = "numpy-generator-state"  # a numpy Generator attribute in a checkpoint: its bit generator's state
DATACLASS_STATE = "dataclass-fields"  # a dataclass attribute (the client-level DP ledger) in a checkpoint: its fields


def state_value(value: Any, where: str) -> Any:
    """A checkpointable copy of an attribute's value: tensors on the CPU; torch modules refused (see state_dict)."""
    if isinstance(value, torch.nn.Module):
        raise TypeError(f"{where} is a torch module: override state_dict/load_state_dict to save its state_dict")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.random.Generator):  # its state as data (a checkpoint holds no objects: fedapps.checkpoint)
        return {GENERATOR_STATE: value.bit_generator.state}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # its fields as data; restored into the object the config builds (load_state_dict), never a class the file names
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        nested = [n for n, f in fields.items() if dataclasses.is_dataclass(f)]
        if nested:
            raise TypeError(f"{where} holds dataclasses ({', '.join(nested)}): override state_dict/load_state_dict")
        return {DATACLASS_STATE: state_value(fields, where), "class": type(value).__name__}
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping's type (a defaultdict keeps its factory)
        out.clear()
        out.update((k, state_value(v, f"{where}[{k!r}]")) for k, v in value.items())
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(state_value(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value
