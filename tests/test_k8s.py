"""The Kubernetes manifests, checked without a cluster: every TFJob validates
against the training operator's CRD schema (../shared/k8s/), with the fields the
operator itself relies on; every pod gets TF_CONFIG exactly as the operator
writes it, and `app` must pick the intended role and strategy from it."""

import copy
import json
import pathlib
import re
import signal

import pytest
import yaml

from app import config as cfg
from app import strategy, train
from app.cluster import chief_failure, memory, preemption
from app.cluster import tf_config as clusters
from app.distribute import data_service

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "launch" / "k8s"
# The Kubeflow training operator's TFJob CRD (v1), beside the project, not in it.
CRD = ROOT.parent / "shared" / "k8s" / "kubeflow.org_tfjobs.yaml"
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


@pytest.mark.parametrize("manifest", ["tfjob-ps.yaml", "tfjob-sync.yaml"])
def test_every_pod_stops_at_its_own_memory_limit_before_the_kernel_kills_it(manifest):
    # The task's limit (RLIMIT_DATA) counts its data, the pod's cgroup its resident
    # pages too: 0.5 GiB between them lets the task name the error (exit 5) first.
    for rt, _, spec in pods(load(manifest)):
        c = container(spec)
        pod_gib = int(c["resources"]["limits"]["memory"].removesuffix("Gi"))
        assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"], rt
        config = cfg.load(None, [a for a in c["args"] if a.startswith("runtime.")])
        assert config.runtime.memory_limit_gib == pod_gib - 0.5, rt
    assert memory.EXIT_CODE < 128  # the operator fails the job: the same limit fails again


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


# -- the manifests against the operator's schema and rules ----------------------------

MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml"))
TFJOBS = [name for name in MANIFESTS if load(name)["kind"] == "TFJob"]
# The training operator's replica types (tfjob_types.go); "Master" is the chief's old name.
REPLICA_TYPES = {"Chief", "Master", "PS", "Worker", "Evaluator"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}  # the CRD's description
CLEAN_POD_POLICIES = {"All", "Running", "None"}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1035, as Services need


def strict(schema: dict) -> dict:
    """The CRD's schema refusing unknown fields, as `kubectl apply` (strict field
    validation) does; the API server would otherwise drop them silently, and a
    misspelled `restartPolicy` would leave the operator's default in force."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@pytest.fixture(scope="module")
def tfjob_validator():
    if not CRD.exists():
        pytest.skip(f"no TFJob CRD at {CRD}: the schema check needs the training operator's "
                    "kubeflow.org_tfjobs.yaml there")
    jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    # OpenAPI v3.0 schemas are JSON Schema draft 4 with extensions (x-kubernetes-*),
    # which validators ignore.
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def schema_errors(validator, job: dict) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(job))


@pytest.mark.parametrize("manifest", TFJOBS)
def test_every_tfjob_validates_against_the_crd_schema(tfjob_validator, manifest):
    job = load(manifest)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert schema_errors(tfjob_validator, job) == []


def test_the_schema_check_catches_an_unknown_field_and_a_wrong_type(tfjob_validator):
    job = load("tfjob-ps.yaml")
    chief = job["spec"]["tfReplicaSpecs"]["Chief"]
    chief["restartPolicyy"] = chief.pop("restartPolicy")
    chief["replicas"] = "1"
    errors = schema_errors(tfjob_validator, job)
    assert any("restartPolicyy" in e and "not allowed" in e for e in errors), errors
    assert any(e.startswith("spec.tfReplicaSpecs.Chief.replicas") for e in errors), errors


@pytest.mark.parametrize("manifest", TFJOBS)
def test_every_tfjob_has_what_the_operator_relies_on(manifest):
    job = load(manifest)
    assert DNS_LABEL.match(job["metadata"]["name"]), "the operator names Services after it"
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in CLEAN_POD_POLICIES
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) <= REPLICA_TYPES, set(specs) - REPLICA_TYPES
    assert sum(specs.get(t, {}).get("replicas", 0) for t in ("Chief", "Master")) <= 1
    assert specs.get("Evaluator", {}).get("replicas", 0) <= 1
    for rt, spec in specs.items():
        assert spec["restartPolicy"] in RESTART_POLICIES, rt
        # The operator sets TF_CONFIG in, and takes the port from, this container only.
        names = [c["name"] for c in spec["template"]["spec"]["containers"]]
        assert names == ["tensorflow"], (rt, names)
        assert container(spec)["image"], rt
        if rt != "Evaluator":  # it serves nothing
            assert "tfjob-port" in {p["name"] for p in container(spec)["ports"]}, rt


@pytest.mark.parametrize("manifest", TFJOBS)
def test_the_restart_policy_retries_exactly_the_exits_a_restart_can_fix(manifest):
    # Under ExitCode the operator restarts a pod after 128..255 and fails the job
    # on 1..127 (tfjob_controller, IsRetryableExitCode).
    for rt, spec in load(manifest)["spec"]["tfReplicaSpecs"].items():
        assert spec["restartPolicy"] == "ExitCode", rt
    retried = {clusters.TaskLost.exit_code, preemption.EXIT_CODE, 128 + signal.SIGKILL}
    assert all(128 <= code <= 255 for code in retried), retried
    # Not a death by signal either: 128 + N for N up to SIGRTMAX.
    assert min(clusters.TaskLost.exit_code, preemption.EXIT_CODE) > 128 + signal.SIGRTMAX
    # A chief that fails for good, and the ps and worker pods it tells (they exit with
    # its code), fail the job: none is restarted, and cleanPodPolicy removes the rest.
    assert all(1 <= code <= 127 for code in chief_failure.PERMANENT)


def test_the_workdir_claim_and_network_policies_are_well_formed():
    kinds = {name: load(name)["kind"] for name in MANIFESTS}
    assert set(kinds.values()) == {"TFJob", "PersistentVolumeClaim", "NetworkPolicy",
                                   "List"}, kinds
    docs = [(name, load(name)) for name in MANIFESTS if kinds[name] != "List"]
    docs += [(name, item) for name in MANIFESTS if kinds[name] == "List"
             for item in load(name)["items"] if item["kind"] == "NetworkPolicy"]
    for name, doc in docs:
        kind = doc["kind"]
        assert DNS_LABEL.match(doc["metadata"]["name"]), name
        if kind == "PersistentVolumeClaim":
            assert doc["apiVersion"] == "v1"
            assert set(doc["spec"]["accessModes"]) <= {
                "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
            # A Kubernetes quantity: digits and a binary or decimal suffix.
            assert re.match(r"^[0-9.]+(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$",
                            doc["spec"]["resources"]["requests"]["storage"]), name
        elif kind == "NetworkPolicy":
            assert doc["apiVersion"] == "networking.k8s.io/v1"
            assert set(doc["spec"]["policyTypes"]) <= {"Ingress", "Egress"}, name
            for rule in doc["spec"].get("ingress", []):
                assert set(rule) <= {"from", "ports"}, name
                for p in rule["ports"]:
                    assert p["protocol"] in ("TCP", "UDP", "SCTP") and 0 < p["port"] < 65536


# -- the tf.data service beside the TFJob ---------------------------------------------


def test_the_data_service_serves_the_tfjob_and_ends_with_its_chief(tfjob_validator):
    """data-service-ps.yaml: a Service for the dispatcher, Jobs for the dispatcher and
    the tf.data workers, whose arguments app.distribute.data_service takes, pointing at each
    other, at the TFJob's chief and workdir; the TFJob reading from it still
    validates, and its config loads."""
    items = {item["metadata"]["name"]: item for item in load("data-service-ps.yaml")["items"]}
    kinds = {name: (item["apiVersion"], item["kind"]) for name, item in items.items()}
    assert kinds == {"mnist-ps-data": ("v1", "Service"),
                     "mnist-ps-data-dispatcher": ("batch/v1", "Job"),
                     "mnist-ps-data-worker": ("batch/v1", "Job"),
                     "mnist-ps-data-ports": ("networking.k8s.io/v1", "NetworkPolicy")}
    service, dispatcher, worker = (items[n] for n in ("mnist-ps-data", "mnist-ps-data-dispatcher",
                                                      "mnist-ps-data-worker"))
    job = load("tfjob-ps.yaml")
    chief = f"{job['metadata']['name']}-chief-0:{port(job['spec']['tfReplicaSpecs']['Chief'])}"
    workdir = container(job["spec"]["tfReplicaSpecs"]["Chief"])["args"]
    workdir = workdir[workdir.index("--workdir") + 1]
    (service_port,) = service["spec"]["ports"]
    address = f"{service['metadata']['name']}:{service_port['port']}"
    pod = dispatcher["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (run,) = pod["spec"]["containers"]
    args = data_service.parse_args(run["args"])
    assert (args.role, args.port, args.watch) == ("dispatcher", service_port["targetPort"], chief)
    assert args.gone_s >= 300  # a restarted chief pod is back well within it
    assert args.work_dir.startswith(workdir + "/")
    (run,) = worker["spec"]["template"]["spec"]["containers"]
    args = data_service.parse_args(run["args"])
    assert (args.role, args.dispatcher, args.watch, args.gone_s) == ("worker", address, chief,
                                                                    600)
    assert args.host == "$(POD_IP)" and [e["name"] for e in run["env"]] == ["POD_IP"]
    for item in (dispatcher, worker):
        spec = item["spec"]["template"]["spec"]
        assert spec["restartPolicy"] == "OnFailure"  # in place: a worker keeps its pod IP
        assert spec["volumes"] == job["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"][
            "volumes"]
    # Every replica of the TFJob told where the dispatcher is.
    for _, _, spec in pods(job):
        container(spec)["args"] += ["--set", f"data.service={address}"]
        args = container(spec)["args"]
        config = cfg.load(str(K8S.parent.parent / args[args.index("--config") + 1]),
                          [a for i, a in enumerate(args) if i and args[i - 1] == "--set"])
        assert config.data.service == address
    assert schema_errors(tfjob_validator, job) == []
