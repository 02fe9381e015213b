import json
import os
import subprocess
import sys

from tools import procstat


def test_peak_memory_is_read_per_process():
    task, peak = procstat.peak_rss([os.getpid()])[os.getpid()]
    assert task == "main" and peak > 50 * 2**20  # this pytest process, TensorFlow loaded


def test_tree_memory_counts_child_processes():
    before = procstat.rss(procstat.tree(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; x = bytearray(300 << 20); x[::4096] = b'1' * "
                              "len(x[::4096]); print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the child has touched its 300 MiB
        assert procstat.rss(procstat.tree(os.getpid())) - before > 250 << 20
    finally:
        child.kill()
        child.wait()


def test_cpu_seconds_are_counted_by_cluster_task_type():
    burn = "import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass\n"
    tf_config = json.dumps({"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}})
    child = subprocess.Popen([sys.executable, "-c", burn + "print(flush=True); input()"],
                             env={**os.environ, "TF_CONFIG": tf_config},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the child has used 1 s of CPU
        used = procstat.cpu_seconds(procstat.tree(os.getpid()))
        assert used[child.pid][0] == "ps" and 0.9 <= used[child.pid][1] < 5
        assert used[os.getpid()][0] == "main"
    finally:
        child.kill()
        child.wait()
