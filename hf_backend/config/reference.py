"""Renders docs/config.md from the config model, so the reference cannot drift from the code.

    python -m hf_backend.config.reference > docs/config.md
"""

from __future__ import annotations

from .schema import (
    DeepSpeedSection,
    FaultToleranceSection,
    FsdpSection,
    LaunchConfig,
    ParallelismSection,
    default_of,
    fields_of,
)

_INTRO = """# Config file reference

Generated from `hf_backend/config/schema.py` by `python -m hf_backend.config.reference > docs/config.md`
(a test fails when this file and the schema disagree).

Files are YAML or JSON, in the layout `accelerate config` writes: hf_backend reads those files as they are and
writes its own the same way. An unknown key, a bad value or a malformed file is a one-line error naming the file,
the key and the fix. Keys marked *accepted, unused* exist in Accelerate and have no effect here; a file that has
them loads, with one note listing them. For precedence between flags, environment, file and script, see
docs/launch.md.
"""


def _table(model: type, prefix: str = "") -> list[str]:
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, f in fields_of(model).items():
        meta = f.metadata
        allowed = ", ".join(map(str, meta["choices"])) if meta["choices"] else ""
        if meta["int_choices"]:
            allowed += " (or " + ", ".join(f"{k}={v}" for k, v in meta["int_choices"].items()) + ")"
        if meta["minimum"] is not None:
            allowed = f">= {meta['minimum']}"
        meaning = meta["help"] + (" *(accepted, unused)*" if meta["unused"] else "")
        if meta["aliases"]:
            meaning += "; also read as " + ", ".join(f"`{a}`" for a in meta["aliases"])
        kind = str(f.type).replace(" | ", " or ")  # a bare | would split the table cell
        rows.append(f"| `{prefix}{name}` | {kind} | `{default_of(f)!r}` | {allowed} | {meaning} |")
    return rows


def render() -> str:
    parts = [_INTRO, "## Top level", "", *_table(LaunchConfig), "",
             "## `fsdp_config`", "", "Keys may also be written without the `fsdp_` prefix (as in transformers' "
             "`fsdp_config` JSON).", "", *_table(FsdpSection), "",
             "## `deepspeed_config`", "", *_table(DeepSpeedSection), "",
             "## `parallelism_config`", "",
             "Each key is also a `hf-backend launch` flag (`--parallelism_config_tp_size 2`), as in `accelerate "
             "launch`; what runs: docs/parallelism.md.", "", *_table(ParallelismSection), "",
             "## `fault_tolerance_config`", "",
             "Read with `fault_tolerance: true`. Each key is also a `hf-backend launch` flag (`--replica_id 1`, "
             "any of them implies `--fault_tolerance`); what runs: docs/fault_tolerance.md.", "",
             *_table(FaultToleranceSection), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
