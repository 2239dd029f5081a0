"""torch.compile by regions: the blocks of a repeated stack (a `ModuleList` whose children share one
class: a transformer's layers) compiled one by one, so that one graph serves every block (the code and
the guards are the same), while the rest (embeddings, final norm, head: little compute) runs eagerly,
as torchtitan compiles. Accelerate's `compile_regions` also compiles that rest, one graph per module.

Every block is compiled in place (`Module.compile`): its `_call_impl` stays on the call path, so the
hooks a strategy put on it run on every call, outside the compiled graph (dynamo skips FSDP2's hooks:
`torch._dynamo.config.skip_fsdp_hooks`). FSDP2's all-gather before a block's forward and its
reduce-scatter after the block's backward therefore run once per block per step, as in eager mode, and
the state-dict keys do not change. (`torch.compile(block)` instead returns an `OptimizedModule` whose
call bypasses the hooks a wrapper puts on the block afterwards.) Whole-model compilation stays in
`Strategy.compile_model`: torch.compile around the strategy's wrapper. Under tensor parallelism the
vocabulary-parallel embedding stays eager in either (tensor_parallel.VocabularyParallelEmbedding).
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch


def is_repeated_stack(module: torch.nn.Module) -> TypeGuard[torch.nn.ModuleList]:
    """A `ModuleList` whose children are all of one class."""
    return isinstance(module, torch.nn.ModuleList) and len(module) > 0 and \
        all(type(child) is type(module[0]) for child in module)


def _holds_a_repeated_stack(module: torch.nn.Module) -> bool:
    return any(is_repeated_stack(m) for m in module.modules())


def is_compiled_in_place(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether any submodule of `module` was compiled, in place or as an `OptimizedModule`."""
    return any(is_compiled_in_place(m) or isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               for m in module.modules() if m is not module)


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Compile `module` by regions, in place (see the module docstring), or whole where it has no
    repeated blocks; returns `module`. A module already compiled is left as it is (a model prepared
    again: no second compilation)."""
    if has_compiled_regions(module) or is_compiled_in_place(module):
        return module
    if _holds_a_repeated_stack(module):
        _compile(module, compile_kwargs)
    else:  # no repeated blocks: the module is the one region
        module.compile(**compile_kwargs)
    return module


def _compile(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if is_repeated_stack(module):
        for block in module:
            block.compile(**kwargs)
    elif _holds_a_repeated_stack(module):
        for child in module.children():
            _compile(child, kwargs)
