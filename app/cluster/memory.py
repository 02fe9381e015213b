"""A memory limit per task (`runtime.memory_limit_gib`), applied inside the task's
own process before TensorFlow starts, and the named error of a task that outgrows it.

How the limit is applied, measured on this project's CPU machine (Linux 6.18,
TensorFlow 2.21, 2 cores, 23 GiB, no swap) with a process that imports
TensorFlow and then holds 256 MiB tensors one after the other:

- cgroups: not used. This machine has cgroup v1's memory controller (owned by
  the container runtime) and a cgroup v2 hierarchy without one, so a child
  cgroup with memory.max cannot be made here, and code that could not be run
  here is not shipped. Under Kubernetes and SLURM the scheduler's cgroup holds
  the same limit from outside (launch/k8s, launch/slurm/train.sbatch).
- RLIMIT_AS: counts every mapping, and TensorFlow's libraries alone map
  1.4 GiB (VmSize after `import tensorflow`, with 0.6 GiB resident): at
  1.5 GiB the import succeeds and the first 256 MiB tensor fails. The limit
  would have to include 1.4 GiB of address space that is never memory.
- RLIMIT_DATA: counts private writable mappings (since Linux 4.7: malloc's heap
  and its mmap'd chunks, TensorFlow's allocator pools, numpy arrays), not the
  libraries' code. At 1.5 GiB: VmData 0.28 GiB after the import, 1.38 GiB with
  two tensors held (RSS 1.45 GiB), and the third raised TensorFlow's
  ResourceExhaustedError ("OOM when allocating tensor"); numpy raises
  MemoryError. This is what `apply_limit` sets, raised by the address space
  of the threads' stacks, which it counts whole (`thread_stacks`): at 1 GiB,
  with pools of 32 and 32 threads a process held no 256 MiB tensor without
  that allowance, and two with it, as many as with pools of 2 and 2.

With TensorFlow's BFC pool (runtime.cpu_allocator = "bfc", or oneDNN on, the
defaults) a failed allocation is retried for 10 s (TensorFlow's AllocatorRetry)
before the op fails; with "malloc" it fails at once.

RLIMIT_DATA is a bound on what the process asks for, not on its resident pages,
and it fails the allocation that crosses it rather than killing the process: the
task names the error and exits with `EXIT_CODE`. Where TensorFlow's C++ does not
check an allocation (a string a tf.data kernel reads into: `tf.io.read_file`, a
TFRecord batch), the refused allocation's NULL pointer is written to and the
process gets SIGSEGV at an address below every mapping of the process (seen here:
0x0, 0x4029, 0x8100000). `catch_failed_allocations` turns exactly that fault into
the same named error and exit code; any other fault crashes as it would. An
allocation that fails in C++ by throwing (gRPC's buffers: std::bad_alloc) aborts
the process instead (SIGABRT, exit -6 or 134); not seen here, and listed in
docs/troubleshooting.md.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import signal
import threading
import time

GIB = 1 << 30
# Not retried (launch.local, Kubeflow's ExitCode policy fails the job on 1..127):
# the same task with the same limit would run out again.
EXIT_CODE = 5
# What a task holds besides its model and data, which tools.plan adds to every
# task's peak. An idle `python -c 'import tensorflow'` here: VmRSS 600 MiB
# (shared libraries' pages included; VmData, what RLIMIT_DATA counts, 280 MiB).
# The tasks of `launch.local --workers 2 --ps 1 --config configs/mnist_ps.toml
# --set task.model=mlp` (2 MiB of variables), peak RSS: ps 688 MiB, workers 717
# and 721, chief 751: a task of a cluster holds about 100 MiB more (gRPC, the
# coordinator's functions). The larger RSS keeps the plan on the safe side.
BASELINE_BYTES = 700 << 20
# The stack each thread this process starts reserves (`small_stacks`), instead of
# RLIMIT_STACK's 8 MiB: TensorFlow's threads run within Windows' 1 MiB default.
THREAD_STACK = 2 << 20
# Threads the limit allows for beyond those running when it was last set: the
# margin for threads started between two looks (`follow_threads`), such as a
# thread pool TensorFlow makes for one graph.
SPARE_THREADS = 64
# Seconds between two looks at this process's threads.
FOLLOW_S = 0.5

# TensorFlow's message names the device, hence the task, that failed to allocate:
# "OOM when allocating tensor with shape[...] ... on /job:ps/replica:0/task:1/device:CPU:0".
_DEVICE = re.compile(r"OOM when allocating.* on /job:(\w+)/replica:\d+/task:(\d+)")
_TENSOR = re.compile(r"OOM when allocating tensor with shape\[([^\]]*)\]")


def stack_bytes() -> int:
    """The address space one new thread's stack reserves: `THREAD_STACK` once
    `small_stacks` has set it, else glibc's default (RLIMIT_STACK)."""
    if _small_stacks:
        return THREAD_STACK
    stack, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 8 << 20 if stack == resource.RLIM_INFINITY else stack


_small_stacks = False


def small_stacks() -> bool:
    """Make `THREAD_STACK` the stack of every thread this process starts from now
    on without asking for a size (glibc's `pthread_setattr_default_np`; the main
    thread keeps its own). False where that is not available (not glibc)."""
    global _small_stacks
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.create_string_buffer(256)  # pthread_attr_t: 56 bytes on x86-64
        ok = (libc.pthread_attr_init(attr) == 0
              and libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(THREAD_STACK)) == 0
              and libc.pthread_setattr_default_np(attr) == 0)
        libc.pthread_attr_destroy(attr)
    except (OSError, AttributeError):
        ok = False
    _small_stacks = _small_stacks or ok
    return ok


def thread_stacks(threads: int | None = None) -> int:
    """Bytes of address space the stacks of this process's threads reserve, with
    `SPARE_THREADS` more: `threads` (default: those running now) of them.

    Each thread's stack is a private writable mapping (`stack_bytes`), which
    RLIMIT_DATA counts whole though a thread touches a few pages of it.
    Measured here with 8 MiB stacks: 7 threads with pools of 2 and 2, VmData
    0.33 GiB; 67 threads with pools of 32 and 32, VmData 0.80 GiB, the same RSS
    (0.61 GiB). A ps task serving 2 workers and a chief runs 104 threads
    (gRPC's and TensorFlow's): 0.8 GiB of VmData that is not memory, and
    thread pools come and go (a failed pthread_create aborts the task)."""
    if threads is None:
        threads = len(os.listdir("/proc/self/task"))
    return (threads + SPARE_THREADS) * stack_bytes()


def apply_limit(gib: float, stacks: int = 0) -> str:
    """Limit this process's data segment (RLIMIT_DATA) to `gib` GiB plus `stacks`
    bytes of thread stacks (`thread_stacks`: address space, not memory); 0: leave
    it. The soft limit only, so that `follow_threads` can move it as threads
    come. A description of what was set, for the log."""
    if not gib:
        return "no memory limit"
    limit = int(gib * GIB) + stacks
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and hard < limit:
        limit = hard  # an unprivileged process cannot raise its hard limit
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return (f"memory limit {gib:g} GiB, RLIMIT_DATA {limit / GIB:.3g} GiB with "
            f"{stacks / GIB:.2g} GiB of thread stacks")


def follow_threads(gib: float) -> threading.Thread:
    """Apply the limit of `gib` GiB now, and keep its allowance for thread stacks
    in step with this process's threads, looking every `FOLLOW_S` seconds from a
    daemon thread. TensorFlow and gRPC start threads as a task serves and
    connects (a ps serving 2 workers: 104), each reserving a stack that
    RLIMIT_DATA counts; a limit fixed before they start would fail a task long
    before its memory reached `gib` (a ps with 1.1 GiB resident, at 2 GiB).
    Threads get `small_stacks`, so that the margin for those started between
    two looks costs 128 MiB of the bound, not 512."""
    small_stacks()
    apply_limit(gib, thread_stacks())

    def follow():
        while True:
            time.sleep(FOLLOW_S)
            apply_limit(gib, thread_stacks())

    watcher = threading.Thread(target=follow, name="memory-limit", daemon=True)
    watcher.start()
    return watcher


class _SigAction(ctypes.Structure):
    """glibc's `struct sigaction` on Linux (x86-64 and aarch64)."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


_SA_SIGINFO, _SA_ONSTACK, _SA_RESETHAND = 0x4, 0x08000000, 0x80000000
# siginfo_t's si_addr: after si_signo, si_errno, si_code and padding (Linux, 64 bits).
_SI_ADDR = 16
_FAULT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_installed: list = []  # the handler, kept alive for as long as the process runs


def _lowest_mapping() -> int:
    with open("/proc/self/maps") as maps:
        return min(int(line.split("-", 1)[0], 16) for line in maps)


def catch_failed_allocations(label: str, gib: float) -> bool:
    """Make a SIGSEGV or SIGBUS at an address below every mapping of this process and
    below the machine's memory (a write through the NULL pointer of an allocation the
    limit refused, in C++ that does not check it) end the task with the named error
    and `EXIT_CODE`, as a failed allocation TensorFlow reports does. Any other fault
    is left to crash as before (the handler resets itself first). False where it
    cannot be installed.

    A handler that runs Python: ctypes takes the GIL, which the thread that faulted
    (a TensorFlow thread) does not hold, and which the main thread releases while
    TensorFlow runs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # NULL plus an offset into the allocation: below the lowest mapping, and less
        # than any allocation the machine could have made (a wild pointer rarely is).
        bound = min(_lowest_mapping(), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return False
    limit = f"its memory limit (runtime.memory_limit_gib = {gib:g} GiB)"

    def on_fault(signum, info, context):
        address = ctypes.c_void_p.from_address(info + _SI_ADDR).value or 0
        if address < bound:
            what = (f"allocating memory in TensorFlow's C++ code, which wrote through the "
                    f"NULL pointer of the refused allocation ({signal.Signals(signum).name} at "
                    f"{address:#x})")
            os.write(2, f"error: {_line(label, limit, what, gib)}\n".encode())
            os._exit(EXIT_CODE)
        # Otherwise return: the default action (SA_RESETHAND) takes the fault again.

    handler = _FAULT_HANDLER(on_fault)
    action = _SigAction(handler=ctypes.cast(handler, ctypes.c_void_p).value,
                        flags=_SA_SIGINFO | _SA_ONSTACK | _SA_RESETHAND)
    for signum in (signal.SIGSEGV, signal.SIGBUS):
        if libc.sigaction(signum, ctypes.byref(action), None) != 0:
            return False
    _installed.append(handler)
    return True


def is_out_of_memory(error: BaseException) -> bool:
    """A failed allocation: numpy's or Python's MemoryError, TensorFlow's
    ResourceExhaustedError of an "OOM when allocating" (read by name: TensorFlow need
    not be imported; its other ResourceExhausted errors, a gRPC message too large,
    are not about memory)."""
    return isinstance(error, MemoryError) or ("OOM" in str(error) and any(
        kind.__name__ == "ResourceExhaustedError" for kind in type(error).__mro__))


def message(error: BaseException, label: str, gib: float) -> str:
    """The one-line error of a task that ran out of its limit. The task is read from
    TensorFlow's message where it names one (an op that failed on another task is
    reported to its caller with that task's device; not yet seen on a cluster here),
    else it is `label`, this task."""
    found = _DEVICE.search(str(error))
    task = f"{found[1]}:{found[2]}" if found and found[1] != "localhost" else label
    if "/device:GPU" in str(error):  # not what the limit counts
        limit = "GPU memory"
    elif gib:
        limit = f"its memory limit (runtime.memory_limit_gib = {gib:g} GiB)"
    else:
        limit = "memory (runtime.memory_limit_gib = 0: no limit of its own)"
    tensor = _TENSOR.search(str(error))
    what = (f"allocating a tensor of shape [{tensor[1]}]" if tensor
            else f"{type(error).__name__} {str(error).strip()[:120]}".strip())
    return _line(task, limit, what, gib)


def _line(task: str, limit: str, what: str, gib: float) -> str:
    return (f"{task} ran out of {limit}, {what}; raise the limit, or add ps tasks to "
            f"spread the tables (python -m tools.plan --config <the run's config> "
            f"--memory-limit-gib {gib:g} says how many); "
            f"exit code {EXIT_CODE}")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (the kernel's VmHWM)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
