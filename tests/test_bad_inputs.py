"""Bad engine and Trainer arguments: each is one line naming the argument and the fix (issue 19's table, and the
ones found next to them). Config files have their own fuzz test; the launcher's signals theirs."""

from __future__ import annotations

import re

import pytest
import torch

from hf_backend import Accelerator, DataLoaderConfiguration, HfBackendError, ProjectConfiguration
from hf_backend.utils import set_seed


@pytest.fixture(scope="module")
def prepared():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator, *accelerator.prepare(model, optimizer)


CASES = [
    ("total_limit=-1", lambda: ProjectConfiguration(total_limit=-1),
     "ProjectConfiguration.total_limit=-1 must be an integer >= 1; None keeps every checkpoint"),
    ("total_limit=0", lambda: ProjectConfiguration(total_limit=0),
     "ProjectConfiguration.total_limit=0 must be an integer >= 1; None keeps every checkpoint"),
    ("iteration=-1", lambda: ProjectConfiguration(iteration=-1),
     "ProjectConfiguration.iteration=-1 must be an integer >= 0"),
    ("project_dir=1", lambda: ProjectConfiguration(project_dir=1),
     "ProjectConfiguration.project_dir=1 must be a path (str or os.PathLike)"),
    ("gradient_accumulation_steps=2.5", lambda: Accelerator(gradient_accumulation_steps=2.5),
     "gradient_accumulation_steps=2.5 must be an integer >= 1"),
    ("gradient_accumulation_steps=True", lambda: Accelerator(gradient_accumulation_steps=True),
     "gradient_accumulation_steps=True must be an integer >= 1"),
    ("cpu='no'", lambda: Accelerator(cpu="no"), "cpu='no' must be True or False"),
    ("split_batches='yes'", lambda: Accelerator(split_batches="yes"), "split_batches='yes' must be True or False"),
    ("device_placement='no'", lambda: Accelerator(device_placement="no"),
     "device_placement='no' must be True or False"),
    ("kwargs_handlers=object", lambda: Accelerator(kwargs_handlers=3),
     "kwargs_handlers=3 must be a list of handlers, e.g. [DistributedDataParallelKwargs(...)]"),
    ("fsdp_plugin=path", lambda: Accelerator(fsdp_plugin="fsdp.yaml"),
     "Accelerator(fsdp_plugin='fsdp.yaml'): pass a FullyShardedDataParallelPlugin(...); a config file goes to "
     "`hf-backend launch --config_file` or TrainingArguments(fsdp_config=...)"),
    ("deepspeed_plugin=path", lambda: Accelerator(deepspeed_plugin="ds.json"),
     "Accelerator(deepspeed_plugin='ds.json'): pass DeepSpeedPlugin(hf_ds_config='ds.json') for a DeepSpeed JSON, "
     "or launch with `hf-backend launch --config_file`"),
    ("project_config='dir'", lambda: Accelerator(project_config="dir"),
     "project_config= takes a ProjectConfiguration, got str (for a directory, pass project_dir=...)"),
    ("dataloader_config={unknown}", lambda: Accelerator(dataloader_config={"splitbatches": True}),
     "dataloader_config: DataLoaderConfiguration has no field splitbatches; fields: data_seed, dispatch_batches, "
     "even_batches, non_blocking, split_batches, use_seedable_sampler, use_stateful_dataloader"),
    ("DataLoaderConfiguration(even_batches=1)", lambda: DataLoaderConfiguration(even_batches=1),
     "DataLoaderConfiguration.even_batches=1 must be True or False"),
    ("set_seed('abc')", lambda: set_seed("abc"), "set_seed: seed must be an integer, got str 'abc'"),
    ("set_seed(-1)", lambda: set_seed(-1), "set_seed: seed=-1 must be from 0 to 2**32 - 1"),
]


@pytest.mark.parametrize("call, expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_one_line(call, expected):
    with pytest.raises(HfBackendError) as caught:
        call()
    assert str(caught.value) == expected


def test_dataloader_config_as_a_dict_is_read_as_its_fields():
    assert Accelerator(dataloader_config={"even_batches": False}).even_batches is False


def test_bad_arguments_of_a_prepared_accelerator(prepared, tmp_path):
    accelerator, model, optimizer = prepared
    cases = [
        (lambda: accelerator.backward("loss"),
         "backward(loss='loss'): pass the loss tensor (e.g. outputs.loss), not a str"),
        (lambda: accelerator.clip_grad_norm_(model.parameters(), "1"),
         "clip_grad_norm_ max_norm='1' must be a positive number"),
        (lambda: accelerator.clip_grad_value_(model.parameters(), -1),
         "clip_grad_value_ clip_value=-1 must be a positive number"),
        (lambda: accelerator.accumulate("model").__enter__(), "accumulate('model'): pass the prepared models"),
        (lambda: setattr(accelerator, "gradient_accumulation_steps", 0),
         "gradient_accumulation_steps=0 must be an integer >= 1"),
        (lambda: accelerator.init_trackers(1), "init_trackers(project_name=1): give the run a name (a non-empty "
                                               "string)"),
        (lambda: accelerator.log("loss"), "log(values='loss'): pass a dict of names to values, e.g. {'loss': 0.5}"),
        (lambda: accelerator.log({"loss": 1.0}, step=1.5), "log step=1.5 must be an integer >= 0"),
        (lambda: accelerator.gather("x"), "gather: str 'x' is not a tensor; gather tensors (or nested lists / dicts of "
                                          "them), and Python objects with gather_object"),
    ]
    for call, expected in cases:
        with pytest.raises(HfBackendError) as caught:
            call()
        assert str(caught.value) == expected


def test_save_state_into_an_existing_file_keeps_the_file(prepared, tmp_path):
    accelerator = prepared[0]
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(HfBackendError, match=rf"^save_state: {re.escape(str(target))} is a file, not a checkpoint "
                                             r"directory; pass a directory \(the file is left as it is\)$"):
        accelerator.save_state(target)
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("name", ["gradient_accumulation_steps", "per_device_train_batch_size",
                                  "per_device_eval_batch_size"])
def test_trainer_arguments_of_zero(tmp_path, name):
    pytest.importorskip("transformers")
    from hf_backend import TrainingArguments

    with pytest.raises(HfBackendError) as caught:
        TrainingArguments(output_dir=str(tmp_path), **{name: 0})
    assert str(caught.value) == f"TrainingArguments.{name}=0 must be an integer >= 1"
