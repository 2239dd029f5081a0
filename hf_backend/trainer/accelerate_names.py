"""transformers' Trainer and TrainingArguments code, run with the engine's object for each name it
imports from accelerate.

transformers' trainer.py and training_args.py import a dozen names from the accelerate package
(`DistributedType`, `skip_first_batches`, `AcceleratorState`, `clear_device_cache`, ...) only when
it is installed, and their methods look them up as module globals: without accelerate those methods
end in a NameError. `engine_named(cls)` is `cls` with each method that uses one of those names
copied (the same code object) onto globals where the name is the engine's object of the same
meaning, so the Trainer runs the same code whether accelerate is installed or not, and never reaches
Accelerate's process state. `unmapped` says which inherited method still uses a name with no engine
object here (tests/test_trainer_compat.py keeps that list empty).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from transformers.trainer_pt_utils import AcceleratorConfig

from ..accelerator import states
from ..accelerator.facade import Accelerator
from ..config import options
from ..core import enums
from ..parallel.config import ParallelismConfig
from ..training import memory
from .transformers_compat import with_globals


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Accelerate's `skip_first_batches`, which transformers' epoch loop calls when it resumes: the
    prepared loader starts its next pass at that batch (an absolute position, consistent with the
    one a checkpoint restored). A stream split across processes keeps the position its checkpoint
    restored: transformers counts a stream's steps as if the run were still in its first pass, and
    that position also holds each process's dataset state."""
    if dataloader.resuming and dataloader.source.restores_its_own_position:
        return dataloader
    return dataloader.skip_first_batches(num_batches)


def _find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                                auto_find_batch_size: bool = False) -> Callable:
    """transformers.trainer_utils' `find_executable_batch_size` (whose search imports accelerate's):
    the engine's search with `auto_find_batch_size`, else the function at the starting size."""
    if function is None:
        return functools.partial(_find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 auto_find_batch_size=auto_find_batch_size)
    if auto_find_batch_size:
        return memory.find_executable_batch_size(function, starting_batch_size=starting_batch_size)
    return functools.partial(function, batch_size=starting_batch_size)


# Each name transformers imports from accelerate (and `find_executable_batch_size`, whose
# transformers version imports accelerate's), and the engine's object of that name.
# AcceleratorConfig is transformers' own class, imported there only when accelerate is installed.
ENGINE_OBJECTS: dict[str, Any] = {
    "Accelerator": Accelerator,
    "AcceleratorConfig": AcceleratorConfig,
    "AcceleratorState": states.AcceleratorState,
    "PartialState": states.PartialState,
    "DistributedType": enums.DistributedType,
    "DataLoaderConfiguration": options.DataLoaderConfiguration,
    "DistributedDataParallelKwargs": options.DistributedDataParallelKwargs,
    "GradientAccumulationPlugin": options.GradientAccumulationPlugin,
    "TorchDynamoPlugin": options.TorchDynamoPlugin,
    "ParallelismConfig": ParallelismConfig,
    "skip_first_batches": _skip_first_batches,
    "release_memory": memory.release_memory,
    "clear_device_cache": memory.clear_device_cache,
    "should_reduce_batch_size": memory.is_out_of_memory,
    "find_executable_batch_size": _find_executable_batch_size,
}
_ALSO_REACHING_ACCELERATE = ("find_executable_batch_size",)


@functools.cache
def imported_from_accelerate(module_name: str) -> frozenset[str]:
    """The module-level names a module imports from the accelerate package, or imports at all under an
    `if is_accelerate_available(...)`; read from its source, so the answer is the same with
    accelerate or without."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt], guarded: bool) -> None:
        for node in statements:
            if isinstance(node, ast.ImportFrom) and (guarded or (node.module or "").split(".")[0] == "accelerate"):
                names.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.If):
                visit(node.body, guarded or "is_accelerate_available" in ast.unparse(node.test))
                visit(node.orelse, guarded)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block, guarded)

    visit(ast.parse(inspect.getsource(sys.modules[module_name])).body, False)
    return frozenset(names)


def _globals_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _globals_used(constant)
    return names


def _functions(member: Any) -> list[Callable[..., Any]]:
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    if isinstance(member, (staticmethod, classmethod)):
        return [member.__func__]
    if isinstance(member, functools.cached_property):
        return [member.func]
    return [member] if isinstance(member, types.FunctionType) else []


def _accelerate_names(member: Any) -> set[str]:
    """The names imported from accelerate that the member's code looks up as globals."""
    used: set[str] = set()
    for function in _functions(member):
        reaching = imported_from_accelerate(function.__module__) | set(_ALSO_REACHING_ACCELERATE)
        used |= _globals_used(function.__code__) & reaching
    return used


def _rebound(member: Any, names: dict[str, Any]) -> Any:
    if isinstance(member, property):
        fget, fset, fdel = (with_globals(f, **names) if f is not None else None
                            for f in (member.fget, member.fset, member.fdel))
        return property(fget, fset, fdel, member.__doc__)
    if isinstance(member, staticmethod):
        return staticmethod(with_globals(member.__func__, **names))
    if isinstance(member, classmethod):
        return classmethod(with_globals(member.__func__, **names))
    if isinstance(member, functools.cached_property):
        made = functools.cached_property(with_globals(member.func, **names))
        made.attrname = member.attrname
        return made
    return with_globals(member, **names)


def engine_named(cls: type) -> type:
    """A subclass of `cls` (transformers' Trainer or TrainingArguments) whose methods that use a name
    imported from accelerate run with the engine's object of each such name that ENGINE_OBJECTS has.
    """
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    for name, member in vars(cls).items():
        names = {n: ENGINE_OBJECTS[n] for n in _accelerate_names(member) if n in ENGINE_OBJECTS}
        if names:
            namespace[name] = _rebound(member, names)
    namespace["_engine_named_from"] = cls
    return type(cls.__name__, (cls,), namespace)


def unmapped(cls: type, engine_class: type) -> dict[str, list[str]]:
    """Each member of transformers' `cls` that `engine_class` inherits (does not override) and that
    uses a name imported from accelerate with no engine object in ENGINE_OBJECTS: without accelerate
    it ends in a NameError."""
    found = {}
    for name, member in vars(cls).items():
        missing = sorted(_accelerate_names(member) - set(ENGINE_OBJECTS))
        owner = next(c for c in engine_class.__mro__ if name in vars(c))
        if missing and (owner is cls or vars(owner).get("_engine_named_from") is cls):
            found[name] = missing
    return found
