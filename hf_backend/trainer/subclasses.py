"""Any `transformers.Trainer` subclass (TRL's trainers, `Seq2SeqTrainer`, a user's own) and its
arguments class on the engine, in one line:

    SFTTrainer, SFTConfig = hf_backend.on_engine(trl.SFTTrainer, trl.SFTConfig)

The trainer becomes `class SFTTrainer(trl.SFTTrainer, hf_backend.Trainer)`: TRL's methods first,
then the engine's overrides of transformers.Trainer, then transformers'. The arguments become the
dataclass `SFTConfig(trl.SFTConfig, hf_backend.TrainingArguments)`, with both classes' fields, so
`to_dict()` round-trips. Both keep their names; they are reachable by pickle under this module (a
checkpoint's `training_args.bin` loads in a fresh process).

Code of the third-party class that asks Accelerate's own state (TRL's `PartialState()` calls,
`set_seed(..., device_specific=True)`, `gather_object`) is told the engine's processes, device and
distributed type (hf_backend/runtime/accelerate_state.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import transformers

from .arguments import TrainingArguments
from .trainer import Trainer

# between the original module and qualified name in a generated class's pickle name
_SEPARATOR = "::"


def on_engine(trainer_class: type | None = None, arguments_class: type | None = None) -> Any:
    """`trainer_class` and/or `arguments_class` (subclasses of transformers' Trainer and
    TrainingArguments) with hf_backend's engine underneath. Given both, returns both (in that
    order); given one, returns it."""
    made = []
    if trainer_class is not None:
        made.append(_on_engine(trainer_class, transformers.Trainer, Trainer, "trainer_class"))
    if arguments_class is not None:
        made.append(_on_engine(arguments_class, transformers.TrainingArguments, TrainingArguments, "arguments_class"))
    if not made:
        raise TypeError("on_engine() needs a Trainer subclass, "
                        "a TrainingArguments subclass, or both")
    return tuple(made) if len(made) == 2 else made[0]


def _on_engine(cls: type, root: type, engine: type, what: str) -> type:
    if not isinstance(cls, type) or not issubclass(cls, root):
        raise TypeError(f"on_engine({what}={cls!r}): needs a subclass of "
                        f"transformers.{root.__name__}")
    if issubclass(cls, engine):
        return cls  # on the engine already
    name = _SEPARATOR.join((cls.__module__.replace(".", ":"), cls.__qualname__.replace(".", ":")))
    if name in _MADE:
        return _MADE[name]
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": cls.__doc__}
    if engine is TrainingArguments:
        made: type = dataclasses.dataclass(type(cls.__name__, (cls, engine), namespace))
    else:
        made = type(cls.__name__, (cls, engine), namespace)
    # dataclass() keeps it; pickle finds the class through __getattr__ below
    made.__qualname__ = name
    _MADE[name] = made
    return made


_MADE: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """A generated class by its pickle name (made again in a process that has not made it yet)."""
    module, separator, qualname = name.partition(_SEPARATOR)
    if not separator:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls: Any = importlib.import_module(module.replace(":", "."))
    for part in qualname.split(":"):
        cls = getattr(cls, part)
    return on_engine(**({"trainer_class": cls} if issubclass(cls, transformers.Trainer) else {"arguments_class": cls}))
