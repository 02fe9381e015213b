import json

import pytest

from app.cluster import tf_config as clusters

PS_CLUSTER = {"chief": ["h0:2222"], "ps": ["h1:2222"], "worker": ["h2:2222", "h3:2222"]}


def tf_config(cluster=None, task_type="worker", index=0, **extra):
    cluster = cluster if cluster is not None else {"worker": ["h0:2222", "h1:2222"]}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


def test_reads_nothing_when_unset(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert clusters.read() is None
    monkeypatch.setenv("TF_CONFIG", "  ")
    assert clusters.read() is None


def test_parameter_server_cluster():
    c = clusters.parse(tf_config(PS_CLUSTER, "worker", 1))
    assert (c.task_type, c.task_index, c.label) == ("worker", 1, "worker:1")
    assert (c.num_workers, c.num_ps, c.has_chief, c.is_multi_task) == (2, 1, True, True)
    assert not c.is_chief
    assert clusters.parse(tf_config(PS_CLUSTER, "chief", 0)).is_chief


def test_worker_zero_is_chief_without_a_chief_job():
    assert clusters.parse(tf_config(task_type="worker", index=0)).is_chief
    assert not clusters.parse(tf_config(task_type="worker", index=1)).is_chief


def test_single_worker_is_not_multi_task():
    assert not clusters.parse(tf_config({"worker": ["localhost:2222"]})).is_multi_task


def test_evaluator_is_left_out_of_the_training_cluster(monkeypatch):
    cluster = {**PS_CLUSTER, "evaluator": ["h9:2222"]}
    text = tf_config(cluster, "chief", 0, environment="cloud")
    c = clusters.parse(text)
    assert "evaluator" not in c.training_jobs
    monkeypatch.setenv("TF_CONFIG", text)
    resolver = c.resolver()
    assert sorted(resolver.cluster_spec().jobs) == ["chief", "ps", "worker"]
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)


def test_an_unlisted_evaluator_is_accepted():
    c = clusters.parse(tf_config(PS_CLUSTER, "evaluator", 0))
    assert c.task_type == "evaluator"


def test_ipv6_and_names_are_valid_addresses():
    c = clusters.parse(tf_config({"worker": ["[::1]:2222", "my-host.svc:1"]}))
    assert c.num_workers == 2


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not valid JSON (Expecting property name enclosed in double "
                  "quotes at line 1 column 2); it should look like {\"cluster\""),
    ("[1, 2]", "TF_CONFIG must be a JSON object like"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "TF_CONFIG has no 'cluster' object"),
    (json.dumps({"cluster": {"worker": ["h:1"]}}), "TF_CONFIG has no 'task' object"),
    (json.dumps({"cluster": {}, "task": {"type": "worker"}}), "TF_CONFIG cluster is empty"),
    (tf_config({"master": ["h:1"]}), "TF_CONFIG cluster.master: unknown job 'master'; "
                                     "jobs are chief, worker, ps, evaluator"),
    (tf_config({"worker": []}), "TF_CONFIG cluster.worker must be a non-empty list"),
    (tf_config({"worker": "h:1"}), "TF_CONFIG cluster.worker must be a non-empty list"),
    (tf_config(task_type="master"), 'TF_CONFIG task.type = "master" is not one of chief, '
                                    "worker, ps, evaluator"),
    (tf_config(task_type=None), "TF_CONFIG task.type = null is not one of"),
    (tf_config(index=2), "TF_CONFIG task.index = 2 is out of range: cluster.worker lists 2 "
                         "task(s), so task.index must be in 0..1"),
    (tf_config(index=-1), "TF_CONFIG task.index = -1 is out of range"),
    (tf_config(index="0"), 'TF_CONFIG task.index = "0" must be an integer'),
    (tf_config(task_type="chief"), "TF_CONFIG task.type = 'chief' but the cluster has no "
                                   "'chief' job; add cluster.chief or fix task.type"),
    (tf_config({"worker": ["h0:2222", "h0:2222"]}),
     "TF_CONFIG cluster.worker[1] = 'h0:2222' is also cluster.worker[0]; every task needs "
     "its own host:port"),
    (tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}),
     "TF_CONFIG cluster.chief lists 2 tasks; there can be at most one chief"),
    (tf_config({"ps": ["a:1"], "worker": ["b:1"]}),
     "TF_CONFIG cluster has a 'ps' job but no 'chief': parameter-server training needs a "
     "chief to coordinate"),
    (tf_config({"chief": ["a:1"], "ps": ["b:1"]}, "chief"),
     "TF_CONFIG cluster has a 'ps' job but no 'worker' job"),
    (tf_config({"worker": ["h0"]}), 'TF_CONFIG cluster.worker[0] = "h0" is not "host:port"'),
    (tf_config({"worker": ["h0:99999"]}), "with a port in 1..65535"),
    (tf_config({"worker": ["h0:0"]}), "with a port in 1..65535"),
    (tf_config({"worker": ["http://h0:80"]}), 'cluster.worker[0] = "http://h0:80" is not'),
    (tf_config({"worker": [2222]}), "cluster.worker[0] = 2222 is not"),
])
def test_mistakes_are_explained(text, message):
    with pytest.raises(clusters.ClusterError) as e:
        clusters.parse(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_lost_peer_is_named_with_its_address_and_never_the_task_itself():
    spec = {"worker": ["a:1", "b:2", "c:3"]}
    me = clusters.parse(json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}}))
    message = ("UNAVAILABLE: recvmsg:Connection timed out from remote target "
               "/job:worker/replica:0/task:1 while running on /job:worker/replica:0/task:0")
    assert clusters.lost_peers(message, me) == "worker:1 (b:2)"
    assert clusters.lost_peers("Socket closed", me) == "a peer worker"


def test_a_lost_ps_is_the_one_an_error_reached_first_not_those_that_relayed_it():
    ps = ["h:1", "h:2"]
    # Trimmed from a step of a run whose ps:1 was SIGKILLed and relaunched: ps:0 had been
    # reading from ps:1, and the worker ran the step.
    relayed = (
        "2 root error(s) found.\n  (0) ABORTED:   RecvTensor expects a different device "
        "incarnation: 31 vs. 17. Your worker job (\"/job:ps/replica:0/task:1\") was probably "
        "restarted.\nAdditional GRPC error information from remote target "
        "/job:ps/replica:0/task:1 while calling /tensorflow.WorkerService/RecvTensor:\n"
        "Additional GRPC error information from remote target /job:ps/replica:0/task:0/"
        "device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
        "  (1) ABORTED:  Unable to find a context_id matching the specified one (16).\n"
        "Additional GRPC error information from remote target /job:ps/replica:0/task:1/"
        "device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0 "
        "while calling /tensorflow.eager.EagerService/Enqueue")
    assert clusters.lost_ps(relayed, ps) == "ps:1 (h:2)"
    # Two root errors, each from a ps of its own: both lost.
    both = ("(0) UNAVAILABLE: reset\nfrom remote target /job:ps/replica:0/task:0 while "
            "(1) UNAVAILABLE: reset\nfrom remote target /job:ps/replica:0/task:1 while")
    assert clusters.lost_ps(both, ps) == "ps:0 (h:1), ps:1 (h:2)"
    # No remote target: every ps the message names; none: which one is not known.
    assert clusters.lost_ps("Socket closed. Encountered when executing an operation on "
                            "/job:ps/replica:0/task:0/device:CPU:0", ps) == "ps:0 (h:1)"
    assert clusters.lost_ps("Socket closed", ps) == "a parameter server"
