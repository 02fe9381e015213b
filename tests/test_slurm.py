"""The SLURM launch, fed a faked SLURM environment: sbatch's script runs
under a stand-in `srun` that starts every rank with --dry-run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from app import train
from app.cluster import tf_config as clusters
from launch import slurm

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("nodelist, hosts", [
    ("node7", ["node7"]),
    ("n[01-03,07],gpu5", ["n01", "n02", "n03", "n07", "gpu5"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
])
def test_node_lists_expand(nodelist, hosts):
    assert slurm.hostnames(nodelist) == hosts


def test_tasks_per_node_expand():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def env(rank: int, nodes: str = "n[1-4]", tasks: str = "1(x4)") -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": tasks}


def test_two_tasks_on_a_node_get_consecutive_ports():
    config = slurm.tf_config(env(3, "n[1-2]", "2(x2)"), num_ps=0, port=2222)
    assert config["cluster"] == {"worker": ["n1:2222", "n1:2223", "n2:2222", "n2:2223"]}
    assert config["task"] == {"type": "worker", "index": 3}


def test_too_few_tasks_for_the_ps_is_an_error():
    with pytest.raises(slurm.SlurmError, match="--ps 3 needs at least 5 SLURM tasks"):
        slurm.tf_config(env(0), num_ps=3, port=2222)


def test_outside_slurm_is_a_clear_error(capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert slurm.main(["--dry-run"]) == 2
    assert "SLURM_PROCID is not set: run this under srun" in capsys.readouterr().err


def run_sbatch(tmp_path: pathlib.Path, extra_env: dict[str, str]) -> list[dict]:
    """Run train.sbatch as SLURM would, with a stand-in srun; each rank's dry-run output."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        "#!/bin/bash\n"
        "while [[ $1 == --* ]]; do shift; done  # srun's own options\n"
        "for ((r = 0; r < SLURM_NTASKS; r++)); do SLURM_PROCID=$r \"$@\" || exit 1; done\n")
    (fake / "srun").chmod(0o755)
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TF_"))}
    environment.update({"PATH": f"{fake}:{environment['PATH']}", "PYTHON": sys.executable,
                        "SLURM_JOB_ID": "42", "SLURM_NTASKS": "4",
                        "SLURM_STEP_NODELIST": "n[1-4]", "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
                        **extra_env})
    result = subprocess.run(["bash", str(ROOT / "launch/slurm/train.sbatch"), "--dry-run"],
                            cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_sbatch_parameter_server_roles(tmp_path):
    ranks = run_sbatch(tmp_path, {})
    clusters_seen = [clusters.parse(json.dumps(r["TF_CONFIG"])) for r in ranks]
    assert [(c.task_type, c.task_index) for c in clusters_seen] == [
        ("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    assert [train.role(c) for c in clusters_seen] == ["train", "serve", "serve", "serve"]
    assert clusters_seen[0].jobs == {"chief": ("n1:2222",), "ps": ("n2:2222",),
                                     "worker": ("n3:2222", "n4:2222")}
    command = ranks[0]["command"]
    assert command[:2] == ["-m", "app.train"]
    assert command[command.index("--workdir") + 1] == str(ROOT / "runs/slurm-42")
    assert command[command.index("--config") + 1] == "configs/mnist_ps.toml"


@pytest.mark.parametrize("extra_env, limit", [
    ({}, None),
    ({"SLURM_MEM_PER_CPU": "2048", "SLURM_CPUS_PER_TASK": "2"}, "3.5"),  # sbatch --mem-per-cpu=2G
    ({"SLURM_MEM_PER_CPU": "2048", "MEMORY_LIMIT_GIB": "1.5"}, "1.5"),
])
def test_sbatch_gives_each_task_a_memory_limit_under_slurms(tmp_path, extra_env, limit):
    for rank in run_sbatch(tmp_path, extra_env):
        given = [a for a in rank["command"] if a.startswith("runtime.memory_limit_gib=")]
        assert given == ([f"runtime.memory_limit_gib={limit}"] if limit else []), rank


def test_sbatch_synchronous_roles(tmp_path):
    ranks = run_sbatch(tmp_path, {"PS": "0", "CONFIG": "configs/mnist_sync.toml"})
    seen = [clusters.parse(json.dumps(r["TF_CONFIG"])) for r in ranks]
    assert [(c.task_type, c.task_index, c.is_chief) for c in seen] == [
        ("worker", i, i == 0) for i in range(4)]
    assert {train.role(c) for c in seen} == {"train"}


def test_sbatch_gives_the_last_tasks_to_the_data_service(tmp_path):
    ranks = run_sbatch(tmp_path, {"DATA_WORKERS": "2", "SLURM_NTASKS": "7",
                                  "SLURM_STEP_NODELIST": "n[1-7]",
                                  "SLURM_STEP_TASKS_PER_NODE": "1(x7)"})
    trainers, service = ranks[:4], ranks[4:]
    assert [r["TF_CONFIG"]["cluster"] for r in trainers] == [{
        "chief": ["n1:2222"], "ps": ["n2:2222"], "worker": ["n3:2222", "n4:2222"]}] * 4
    for rank in trainers:
        assert "data.service=n5:2222" in rank["command"]
    workdir = str(ROOT / "runs/slurm-42")
    assert [r["TF_CONFIG"] for r in service] == [None] * 3
    assert [r["command"] for r in service] == [
        ["-m", "app.distribute.data_service", "dispatcher", "--port", "2222", "--work-dir",
         f"{workdir}/data_service", "--watch", "n1:2222"],
        *[["-m", "app.distribute.data_service", "worker", "--dispatcher", "n5:2222", "--port",
           "2222", "--host", host, "--watch", "n1:2222"] for host in ("n6", "n7")]]


def test_too_few_tasks_for_the_data_service_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", {"SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[1-3]",
                                        "SLURM_STEP_TASKS_PER_NODE": "1(x3)"})
    assert slurm.main(["--data-workers", "2", "--workdir", "w", "--dry-run"]) == 2
    assert "--data-workers 2 needs 3 SLURM tasks for the service besides the training " \
           "tasks, the step has 3" in capsys.readouterr().err


def test_the_data_service_without_the_runs_workdir_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", {"SLURM_PROCID": "4", "SLURM_STEP_NODELIST": "n[1-6]",
                                        "SLURM_STEP_TASKS_PER_NODE": "1(x6)"})
    assert slurm.main(["--data-workers", "1", "--dry-run"]) == 2
    assert "--data-workers needs the run's --workdir" in capsys.readouterr().err
    assert slurm.main(["--data-workers", "1", "--workdir=runs/w", "--dry-run"]) == 0
    assert "runs/w/data_service" in capsys.readouterr().out


def sbatch_options() -> dict[str, str]:
    """The script's #SBATCH options, as sbatch reads them (up to its first command)."""
    options = {}
    for line in (ROOT / "launch/slurm/train.sbatch").read_text().splitlines()[1:]:
        if line.startswith("#SBATCH "):
            name, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[name] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


def test_sbatch_sends_every_task_sigterm_in_time_to_save_a_backup():
    options = sbatch_options()
    signal_, _, seconds = options["--signal"].partition("@")
    # Not "B:TERM": that would signal the batch script alone, never the training tasks.
    assert signal_ in ("TERM", "15") and int(seconds) >= 120, options["--signal"]
    assert "--requeue" in options  # the same job id, so the same WORKDIR, after preemption


def test_a_task_whose_port_is_not_its_ranks_is_an_error():
    # Cyclic distribution: rank 1 runs on the second node, as its first task.
    environment = {**env(1, "n[1-2]", "2(x2)"), "SLURM_NODEID": "1", "SLURM_LOCALID": "0"}
    with pytest.raises(slurm.SlurmError, match="listens on n2:2222, but rank 1's address in "
                       "node order is n1:2223: run srun with --distribution=block"):
        slurm.tf_config(environment, num_ps=0, port=2222)


def test_each_task_of_a_node_listens_on_the_base_port_plus_its_local_id():
    for rank, (node, local) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0)]):
        environment = {**env(rank, "n[1-2]", "3,1"), "SLURM_NODEID": str(node),
                       "SLURM_LOCALID": str(local)}
        config = slurm.tf_config(environment, num_ps=1, port=2222)
        assert config["cluster"] == {"chief": ["n1:2222"], "ps": ["n1:2223"],
                                     "worker": ["n1:2224", "n2:2222"]}


def fake_scontrol(tmp_path: pathlib.Path, monkeypatch) -> pathlib.Path:
    """An `scontrol` on PATH that records its arguments; the file it writes."""
    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {calls}\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    return calls


def test_a_preempted_job_requeues_itself(tmp_path, monkeypatch, capsys):
    from app.cluster.preemption import EXIT_CODE
    from launch.slurm import requeue

    calls = fake_scontrol(tmp_path, monkeypatch)
    assert requeue.main([str(EXIT_CODE)]) == EXIT_CODE
    assert calls.read_text() == "requeue 42\n"
    assert "job 42 preempted, backup saved" in capsys.readouterr().out


@pytest.mark.parametrize("status", [0, 1, 2, 3])
def test_any_other_exit_is_passed_on_without_a_requeue(tmp_path, monkeypatch, status):
    from launch.slurm import requeue

    calls = fake_scontrol(tmp_path, monkeypatch)
    assert requeue.main([str(status)]) == status
    assert not calls.exists()


def test_the_local_cluster_refuses_to_start_without_root(tmp_path, monkeypatch, capsys):
    from launch.slurm import local_cluster

    monkeypatch.setattr(local_cluster.os, "geteuid", lambda: 1000)
    assert local_cluster.main(["start", "--dir", str(tmp_path)]) == 2
    assert "error: the local SLURM cluster needs root" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, nothing started


def test_the_local_cluster_names_the_missing_packages_without_apt(monkeypatch):
    from launch.slurm import local_cluster

    monkeypatch.setattr(local_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(local_cluster, "which", lambda name: None)
    assert local_cluster.missing_prerequisite() == (
        "SLURM's packages munge slurmctld slurmd slurm-client are not installed and there is "
        "no apt-get to install them: install them with this system's package manager")


def test_a_port_in_use_is_named_with_the_flag_that_moves_it():
    import socket

    from launch.slurm import local_cluster

    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(local_cluster.ClusterError,
                           match=f"port {port} is in use .* pass --ctld-port with a free port"):
            local_cluster.check_port(port, "--ctld-port")


def test_thread_pools_follow_the_tasks_cpus_unless_set(tmp_path):
    config = slurm.tf_config(env(0), num_ps=1, port=2222)  # 2 workers
    cpus = {**env(0), "SLURM_CPUS_PER_TASK": "2"}
    assert slurm.thread_settings(cpus, config, []) == [
        "--set", "runtime.inter_op_threads=3", "--set", "runtime.intra_op_threads=2"]
    assert slurm.thread_settings(cpus, config, ["--set", "runtime.intra_op_threads=1"]) == [
        "--set", "runtime.inter_op_threads=3"]
    # A key the --config file sets is chosen too: the launcher's own --set, which
    # comes first, would override the file's value.
    toml = tmp_path / "run.toml"
    toml.write_text("[runtime]\nintra_op_threads = 1\n")
    assert slurm.thread_settings(cpus, config, ["--config", str(toml), "--workdir", "w"]) == [
        "--set", "runtime.inter_op_threads=3"]


def test_tasks_that_share_a_node_sleep_when_idle_unless_set():
    spinning = "runtime.thread_spinning=false"
    # 2 nodes, 2 tasks each; 4 nodes of one task each.
    shared, alone = env(3, "n[1-2]", "2(x2)"), env(3)
    config = slurm.tf_config(shared, num_ps=1, port=2222)
    assert spinning in slurm.thread_settings(shared, config, [])
    assert spinning not in slurm.thread_settings(alone, slurm.tf_config(alone, 1, 2222), [])
    assert slurm.thread_settings(shared, config, ["--set", "runtime.thread_spinning=true"]) == [
        "--set", "runtime.inter_op_threads=3"]
    # The only training task, beside the tf.data service's dispatcher on its node.
    beside_service = env(0, "n[1-2]", "2,1")
    config = slurm.tf_config(beside_service, num_ps=0, port=2222, data_workers=1)
    assert config["cluster"] == {"worker": ["n1:2222"]}
    assert spinning in slurm.thread_settings(beside_service, config, [])


def test_the_local_cluster_signals_only_the_daemons_it_started(tmp_path):
    from launch.slurm import local_cluster

    # A pid file whose process is no longer slurmd (the pid recycled: here, pytest).
    local_cluster.pid_file(tmp_path, "slurmd").write_text(f"{os.getpid()}\n")
    assert local_cluster.running(tmp_path, "slurmd") is None
    local_cluster.stop(tmp_path)  # must not signal this process
    assert not local_cluster.pid_file(tmp_path, "slurmd").exists()


def test_the_local_node_declares_the_cpus_asked_for_not_the_real_ones():
    from launch.slurm import slurm_conf

    slurmd_c = ("NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 "
                "ThreadsPerCore=1 RealMemory=24105\nUpTime=0-00:02:35\n")
    node = slurm_conf.node_line(slurmd_c, 8)
    assert node.startswith("NodeName=vm CPUs=8 ") and "RealMemory=24105" in node
    conf = slurm_conf.slurm_conf(pathlib.Path("/tmp/x"), node, 6817, 6818)
    # Without config_overrides slurmd would refuse a node of 8 CPUs on 2 cores.
    assert "SlurmdParameters=config_overrides" in conf.splitlines()
    assert "SlurmctldHost=vm" in conf.splitlines() and node in conf.splitlines()
