"""The transformers versions hf_backend.Trainer supports, and what differs between them, in one place.

trainer.py builds on Trainer internals (docs/trainer.md lists them). From 5.17 to 5.24 these
changed, and the rest of hf_backend asks here instead of looking at transformers' version:

| internal | 5.17, 5.18 | 5.19 - 5.22 | 5.23, 5.24 |
|---|---|---|---|
| argument turning on activation checkpointing | `gradient_checkpointing` | same | `activation_checkpointing` |
| the model's flag for it | `is_gradient_checkpointing` | same | `is_activation_checkpointing` |
| `Trainer.loss_is_scaled_for_ga` | absent (read as None) | None unless set | same |
| `Trainer._run_epoch` (see below) | the 5.17 loop | same | + models sharded at load time |
| `Trainer._save` on a process that must not write | writes | same | returns (trainer.py asks `should_save`) |
| transformers.Trainer resumes an optimizer under DDP on CPU | 5.17: no (1) | yes | yes |

(5.23 keeps the old names as deprecated aliases that warn.) (1): transformers' own Trainer, not this
one: 5.17 loads `optimizer.pt` with map_location "cpu:0", which torch cannot restore (fixed in
5.18); only the tests ask.

`Trainer._run_epoch` runs with the engine's `skip_first_batches` in place of Accelerate's
(accelerate_names.py), and how a run resumes rests on it: RUN_EPOCH_FINGERPRINTS records it for each
supported minor; tests/test_trainer_compat.py fails when the installed one differs, and a differing
one warns at import: review what changed, then record the new fingerprint. One statement of it, the
same in every supported version, runs in another form: the step loss added to the logged sum, whose
`logging_nan_inf_filter` test waits for the device after every backward (`loss_filter_on_device`).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import io
import textwrap
import tokenize
import types
from collections.abc import Callable
from typing import Any, TypeVar

import transformers
from packaging.version import Version

from ..core.notes import warn

F = TypeVar("F", bound=Callable[..., Any])
OLDEST, NEWEST = (5, 17), (5, 24)
_RELEASE = Version(transformers.__version__).release[:2]
# fingerprint(transformers.Trainer._run_epoch) of each supported minor (the same in every patch
# release of it).
RUN_EPOCH_FINGERPRINTS = {
    **dict.fromkeys(("5.17", "5.18", "5.19", "5.20", "5.21", "5.22"), "02f7d1200db9626b"),
    # 5.23: a branch for models sharded at load time (FSDP's gradient reduction deferred)
    **dict.fromkeys(("5.23", "5.24"), "f6339c3ff4b7407b"),
}
# Trainer members trainer.py overrides or calls, present in every supported version.
_NEEDED = ("_run_epoch", "_get_num_items_in_batch", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
           "_load_from_checkpoint", "_load_best_model", "_prepare_for_training", "_load_scaler",
           "create_accelerator_and_postprocess", "get_train_dataloader", "get_eval_dataloader", "get_test_dataloader",
           "_save")


def minor(version: str = transformers.__version__) -> str:
    """'5.20' for '5.20.2' (and for '5.20.0.dev0')."""
    return "{}.{}".format(*Version(version).release[:2])


def _span() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def check_version() -> None:
    """At import: older than OLDEST is an error; newer than NEWEST, or a `_run_epoch` not recorded, a
    warning."""
    installed, release = transformers.__version__, _RELEASE
    missing = [name for name in _NEEDED if not hasattr(transformers.Trainer, name)]
    if release < OLDEST or missing:
        raise ImportError(f"hf_backend.Trainer needs transformers {_span()} (it builds on Trainer "
                          f"internals that older versions lack); you have {installed}: pip install "
                          f"'transformers>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}'")
    if release > NEWEST:
        warn(f"hf_backend.Trainer is tested with transformers {_span()}; you have {installed} "
             "(docs/trainer.md lists the internals it relies on)")
    elif fingerprint(transformers.Trainer._run_epoch) != RUN_EPOCH_FINGERPRINTS[minor(installed)]:
        warn(f"transformers {installed}'s Trainer._run_epoch is not the one "
             f"hf_backend.Trainer was tested with for {minor(installed)} "
             "(it runs that loop); report it with `hf-backend env`")


def fingerprint(function: Any) -> str:
    """A hash of the function's source (see `source_fingerprint`)."""
    return source_fingerprint(inspect.getsource(function))


def source_fingerprint(source: str) -> str:
    """A hash of `source` with comments, trailing spaces and blank lines left out: the same under every
    Python version (tokenize only finds the comments)."""
    source = textwrap.dedent(source)
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            lines[row - 1] = lines[row - 1][:column]
    text = "\n".join(line.rstrip() for line in lines if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_globals(function: Callable[..., Any], **names: Any) -> types.FunctionType:
    """`function` (unchanged code) looking up `names` in place of its module's globals of the same
    names."""
    rebound = types.FunctionType(function.__code__, {**function.__globals__, **names}, function.__name__,
                                 function.__defaults__, function.__closure__)
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    return rebound


# -- names that changed ----------------------------------------------------------------------------
_ARGUMENT_FIELDS = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
# The TrainingArguments field that turns on activation checkpointing (5.23 renamed it).
ACTIVATION_CHECKPOINTING_ARGUMENT = ("activation_checkpointing" if "activation_checkpointing" in _ARGUMENT_FIELDS
                                     else "gradient_checkpointing")
_MODEL_FLAG = ("is_activation_checkpointing" if hasattr(transformers.PreTrainedModel, "is_activation_checkpointing")
               else "is_gradient_checkpointing")


# transformers.Trainer itself resumes an optimizer state under DDP on CPU (the table's note 1).
STOCK_TRAINER_RESUMES_UNDER_CPU_DDP = _RELEASE >= (5, 18)


def activation_checkpointing(args: Any) -> bool:
    """Whether the TrainingArguments turn on activation checkpointing."""
    return bool(getattr(args, ACTIVATION_CHECKPOINTING_ARGUMENT))


def model_activation_checkpointing(model: Any) -> bool:
    """Whether a PreTrainedModel has activation checkpointing on."""
    return bool(getattr(model, _MODEL_FLAG))


def loss_is_scaled_for_ga(trainer: Any) -> bool | None:
    """`Trainer.loss_is_scaled_for_ga` (5.19 on; before, None: the Trainer decided from the model's
    loss kwargs)."""
    return getattr(trainer, "loss_is_scaled_for_ga", None)


# -- the logged loss's NaN/inf filter, on the device ----------------------------------------------
# The statement of transformers' `_run_epoch` (5.17 to 5.24) that adds a step's loss to the logged
# sum. Its `logging_nan_inf_filter` test turns `torch.isnan(loss)` into a Python bool: the host
# waits for the device after every backward, before it launches the clipping and optimizer kernels.
_LOGGED_LOSS = """
if (self.args.logging_nan_inf_filter and not is_torch_xla_available()
        and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step))):
    self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
else:
    if self._tr_loss.device != tr_loss_step.device:
        raise ValueError(
            f"Calculated loss must be on the original device: {self._tr_loss.device} "
            f"but device in use is {tr_loss_step.device}"
        )
    self._tr_loss += tr_loss_step
"""
# What hf_backend.Trainer runs in its place: the same sum, the filter computed on the device
# (`Trainer._loss_to_log`).
_LOGGED_LOSS_ON_DEVICE = "self._tr_loss += self._loss_to_log(tr_loss_step)"


def loss_filter_on_device(function: F) -> F:
    """`function` (transformers' `Trainer._run_epoch`) with the statement _LOGGED_LOSS replaced by
    _LOGGED_LOSS_ON_DEVICE; the rest is transformers' code, compiled from its source with its file
    name, line numbers and globals. Returned unchanged when that statement is not in it exactly once
    (a transformers release that changed it: the loop then keeps its host sync, and
    tests/test_trainer_step.py and tests/test_trainer_compat.py fail)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    wanted = ast.dump(ast.parse(_LOGGED_LOSS).body[0])
    found = []

    class Replace(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST:
            if ast.dump(node) != wanted:
                return self.generic_visit(node)
            found.append(node)
            statement = ast.parse(_LOGGED_LOSS_ON_DEVICE).body[0]  # one line, where the `if` was
            for part in ast.walk(statement):
                if isinstance(part, (ast.stmt, ast.expr)):  # the nodes with a position (all, in this statement)
                    part.lineno = part.end_lineno = node.lineno
                    part.col_offset += node.col_offset
                    if part.end_col_offset is not None:
                        part.end_col_offset += node.col_offset
            return statement

    tree = Replace().visit(tree)
    if len(found) != 1 or function.__code__.co_freevars or len(tree.body) != 1:
        return function
    namespace: dict[str, Any] = {}
    exec(compile(tree, function.__code__.co_filename, "exec"), function.__globals__, namespace)
    made = namespace[function.__name__]
    made.__defaults__, made.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    made.__qualname__, made.__doc__ = function.__qualname__, function.__doc__
    return made
