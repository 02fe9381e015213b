"""The Kubernetes manifests, checked without a cluster: every pod of each TFJob
gets TF_CONFIG exactly as Kubeflow's training operator writes it, and `app`
must pick the intended role and strategy from it."""

import json
import pathlib

import pytest
import yaml

from app import cluster as clusters
from app import config as cfg
from app import strategy, train

K8S = pathlib.Path(__file__).resolve().parent.parent / "launch" / "k8s"
NAMESPACE = "ml"
DEFAULT_PORT = 2222  # the operator's port when a replica names none


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def container(replica: dict) -> dict:
    (c,) = replica["template"]["spec"]["containers"]
    return c


def port(replica: dict) -> int:
    ports = {p["name"]: p["containerPort"] for p in container(replica).get("ports", [])}
    return ports.get("tfjob-port", DEFAULT_PORT)


def operator_tf_config(job: dict, replica_type: str, index: int) -> str:
    """TF_CONFIG as the training operator writes it for one pod."""
    name, specs = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]
    cluster = {rt.lower(): [f"{name}-{rt.lower()}-{i}.{NAMESPACE}.svc:{port(spec)}"
                            for i in range(spec["replicas"])]
               for rt, spec in specs.items()}
    return json.dumps({"cluster": cluster, "task": {"type": replica_type.lower(), "index": index},
                       "environment": "cloud"})


def pods(job: dict):
    for rt, spec in job["spec"]["tfReplicaSpecs"].items():
        for i in range(spec["replicas"]):
            yield rt, i, spec


def decision(job: dict, replica_type: str, index: int, spec: dict) -> tuple[str, str | None]:
    """(role, strategy) that app.train reaches in this pod, on a machine without GPUs."""
    args = container(spec)["args"]
    config = cfg.load(str(K8S.parent.parent / args[args.index("--config") + 1]))
    cluster = clusters.parse(operator_tf_config(job, replica_type, index))
    role = train.role(cluster)
    return role, strategy.choose(config.runtime.strategy, cluster, 0) if role == "train" else None


@pytest.mark.parametrize("manifest, expected", [
    ("tfjob-ps.yaml", {"Chief": ("train", "parameter_server"), "PS": ("serve", None),
                       "Worker": ("serve", None), "Evaluator": ("evaluate", None)}),
    ("tfjob-sync.yaml", {"Worker": ("train", "multi_worker_mirrored")}),
])
def test_every_pod_takes_its_intended_role(manifest, expected):
    job = load(manifest)
    assert set(job["spec"]["tfReplicaSpecs"]) == set(expected)
    for rt, i, spec in pods(job):
        assert decision(job, rt, i, spec) == expected[rt], f"{rt} {i}"


def test_outputs_are_written_by_exactly_one_pod():
    for manifest in ("tfjob-ps.yaml", "tfjob-sync.yaml"):
        job = load(manifest)
        writers = [(rt, i) for rt, i, _ in pods(job) if clusters.parse(
            operator_tf_config(job, rt, i)).is_chief]
        assert len(writers) == 1, manifest


@pytest.mark.parametrize("manifest", ["tfjob-ps.yaml", "tfjob-sync.yaml"])
def test_all_pods_share_one_workdir_on_the_shared_volume(manifest):
    job = load(manifest)
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    pvc = load("workdir-pvc.yaml")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    workdirs = set()
    for rt, _, spec in pods(job):
        c = container(spec)
        args = c["args"]
        workdir = args[args.index("--workdir") + 1]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        (name,) = [n for n, path in mounts.items() if workdir.startswith(path + "/")]
        assert volumes[name]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], rt
        workdirs.add(workdir)
    assert len(workdirs) == 1


@pytest.mark.parametrize("job_name", ["ps", "sync"])
def test_only_the_jobs_own_pods_reach_the_grpc_port(job_name):
    job = load(f"tfjob-{job_name}.yaml")
    policy = load(f"networkpolicy-{job_name}.yaml")
    own = {"training.kubeflow.org/job-name": job["metadata"]["name"]}
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": own}}]
    ports = {port(spec) for _, _, spec in pods(job)}
    assert [p["port"] for p in rule["ports"]] == sorted(ports)


def test_the_image_holds_what_the_pods_run():
    dockerfile = (K8S / "Dockerfile").read_text()
    for needed in ("app", "configs", "data", "launch"):
        assert f"COPY {needed} ./{needed}" in dockerfile
    assert 'ENTRYPOINT ["python", "-m", "app.train"]' in dockerfile


@pytest.mark.parametrize("manifest", ["tfjob-ps.yaml", "tfjob-sync.yaml"])
def test_every_pod_has_time_to_save_a_backup_when_evicted(manifest):
    # Kubernetes' default is 30 s between SIGTERM and SIGKILL; a training task
    # needs a step, an epoch's evaluation at worst, and the backup's write.
    job = load(manifest)
    for rt, _, spec in pods(job):
        assert spec["template"]["spec"].get("terminationGracePeriodSeconds", 30) >= 120, rt
