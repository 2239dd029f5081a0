"""The `hf-backend` command line: launch (one machine, two machines on loopback, a failing rank), config, env."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from helpers import CLI, DOCS_FSDP_YAML, SCRIPTS, cli, cli_env, free_port, run_report

from hf_backend.cli.main import build_parser, main
from hf_backend.config.loader import load_config


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return run_report("tutorial_loop.py", tmp_path_factory.mktemp("one") / "r.json", ["--batch-size", "16"])


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> None:
    assert max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_launch_cpu_two_processes_trains_one_model_like_one_process_with_twice_the_batch(one_process, tmp_path):
    out = tmp_path / "r.json"
    proc = cli("launch", "--cpu", "--num_processes", "2", str(SCRIPTS / "tutorial_loop.py"), "--out", str(out),
               "--batch-size", "8", "--seed-per-rank", HF_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world"] == 2 and two["ranks_agree"]
    _close(two["losses"], one_process["losses"])
    _close(two["params"], one_process["params"])


def test_two_launchers_on_loopback_form_one_two_node_job(one_process, tmp_path):
    port = str(free_port())
    out = tmp_path / "r.json"
    common = ["launch", "--cpu", "--num_processes", "2", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", port, "--num_cpu_threads_per_process", "1"]
    script = [str(SCRIPTS / "tutorial_loop.py"), "--out", str(out), "--batch-size", "8"]
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = []
    for rank, log in enumerate(logs):  # output to files, never an unread pipe that could fill and stall a node
        with log.open("w") as sink:
            nodes.append(subprocess.Popen([*CLI, *common, "--machine_rank", str(rank), *script], stdout=sink,
                                          stderr=subprocess.STDOUT, text=True, env=cli_env(HF_HOME=str(tmp_path))))
    deadline = time.monotonic() + 120  # about 10 s when it works; a node that failed ends the wait at once
    while time.monotonic() < deadline:
        codes = [node.poll() for node in nodes]
        if None not in codes or any(code not in (None, 0) for code in codes):
            break
        time.sleep(0.2)
    for node in nodes:
        if node.poll() is None:
            _kill_tree(node.pid)
            node.wait()
    report = "\n".join(f"node {rank} (exit {node.returncode}):\n{log.read_text()[-3000:]}"
                       for rank, (node, log) in enumerate(zip(nodes, logs)))
    assert all(node.returncode == 0 for node in nodes), report
    two = json.loads(out.read_text())
    assert two["world"] == 2 and two["ranks_agree"]
    _close(two["params"], one_process["params"])


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (torch elastic starts each worker in a session of its own)."""
    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_failing_rank_fails_the_launch_fast_and_is_named(tmp_path):
    start = time.monotonic()
    proc = cli("launch", "--cpu", "--num_processes", "2", str(SCRIPTS / "fail_rank.py"), timeout=120,
               HF_HOME=str(tmp_path))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("hf-backend launch: rank 1 (local rank 1) exited with code 1: ValueError: boom on rank 1; "
                    "the other workers were stopped")
    assert time.monotonic() - start < 60


def test_the_docs_fsdp_yaml_reaches_every_process(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(DOCS_FSDP_YAML)
    out = tmp_path / "seen.json"
    proc = cli("launch", "--config_file", str(config), "--cpu", "-m", "show_launch_config", str(out),
               HF_HOME=str(tmp_path), PYTHONPATH=str(SCRIPTS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["world"] == "2" and seen["threads"] == "1"  # 2 cores, 2 processes: no oversubscription
    assert seen["config"]["distributed_type"] == "FSDP" and seen["config"]["mixed_precision"] == "bf16"
    fsdp = seen["config"]["fsdp_config"]
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer" and fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_launch_errors_are_one_line(tmp_path):
    proc = cli("launch", "--num_processes", "two", "x.py", HF_HOME=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("hf-backend launch: error: command line: num_processes='two' is not valid; "
                                   "use a whole number")
    proc = cli("launch", "--cpu", str(tmp_path / "missing.py"), HF_HOME=str(tmp_path))
    assert proc.returncode == 2 and "no script at" in proc.stderr and proc.stderr.count("\n") == 1


def test_the_scripts_own_flags_pass_through_even_when_they_look_like_launch_flags(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys; print(sys.argv[1:])")
    proc = cli("launch", "--cpu", str(script), "--deepspeed", "ds.json", "--num_processes", "3", HF_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['--deepspeed', 'ds.json', '--num_processes', '3']"


def test_interactive_config_reads_piped_answers(tmp_path):
    path = tmp_path / "answers.yaml"
    # machine type, machines, processes, FSDP?, sharding, offload, wrap policy, layer class, state dict,
    # ParallelismConfig? (its sizes: dp_replicate, dp_shard, tp, cp, sp, ep, pp), precision
    answers = "cpu\n1\n4\nyes\nSHARD_GRAD_OP\nno\n\nBertLayer\nSHARDED_STATE_DICT\nyes\n1\n2\n2\n1\n1\n1\n1\nbf16\n"
    proc = cli("config", "--config_file", str(path), input=answers)
    assert proc.returncode == 0, proc.stderr
    config = load_config(path)
    assert (config.distributed_type, config.num_processes, config.use_cpu, config.mixed_precision) == (
        "FSDP", 4, True, "bf16")
    assert (config.parallelism.parallelism_config_dp_shard_size, config.parallelism.parallelism_config_tp_size) == (
        2, 2)
    assert config.fsdp.fsdp_sharding_strategy == "SHARD_GRAD_OP"
    assert config.fsdp.fsdp_transformer_layer_cls_to_wrap == "BertLayer"


def test_interactive_config_names_a_bad_or_missing_answer(tmp_path):
    proc = cli("config", "--config_file", str(tmp_path / "c.yaml"), input="cpu\n1\n")
    assert proc.returncode == 2 and "the answers ended at question 3" in proc.stderr
    proc = cli("config", "--config_file", str(tmp_path / "c.yaml"), input="cpu\none\n")
    assert proc.returncode == 2 and "num_machines='one' is not valid; use a whole number" in proc.stderr


def test_config_default_writes_under_hf_home_and_validate_checks_it(tmp_path):
    proc = cli("config", "default", "--num_processes", "2", "--mixed_precision", "bf16", HF_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "hf_backend" / "default_config.yaml"
    assert load_config(path).distributed_type == "MULTI_CPU"
    proc = cli("config", "validate", str(path))
    assert proc.returncode == 0 and "valid" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("mixed_precison: bf16\n")
    proc = cli("config", "validate", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"hf-backend config: error: {bad}: unknown key 'mixed_precison'; "
                                   "did you mean 'mixed_precision'?")


def test_env_reports_versions_devices_and_the_config_in_effect(tmp_path, monkeypatch, capsys):
    cli("config", "default", HF_HOME=str(tmp_path))
    # `env` imports torch: run here, where it is imported already, in the environment `cli` gives its processes
    for name in [name for name in os.environ if name.startswith("HF_BACKEND_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in ("hf_backend: 0.", "torch: 2.", "transformers: ", "deepspeed: ", "cpu cores: ",
                   f"config file: {tmp_path / 'hf_backend' / 'default_config.yaml'}", "distributed_type: NO",
                   "launcher settings in this environment: none"):
        assert needle in out


def test_version_and_every_flag_has_help():
    proc = cli("--version")
    assert proc.stdout.startswith("hf-backend 0.")

    def check(parser: argparse.ArgumentParser, where: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    check(sub, f"{where} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                assert action.help, f"{where}: {action.dest} has no help text"

    check(build_parser(), "hf-backend")


def test_config_commands_start_without_importing_torch(tmp_path):
    """`hf-backend config ...` and `--version` answer in a fraction of a second: hf_backend imports lazily."""
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    code = ("import sys; from hf_backend.cli.main import main; import hf_backend; "
            f"code = main(['config', 'validate', {str(path)!r}]); "
            "assert sorted(hf_backend.__all__) == sorted(hf_backend._WHERE); "
            "print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("0 False")
