"""Building airserve's C++ operators: a lock left by an interrupted build must not hang start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from airserve.srt.layers import cpu_kernels


def test_a_stale_build_lock_is_removed_and_the_build_completes(tmp_path):
    """torch waits forever on a build directory's `lock` file; one older than
    STALE_LOCK_SECONDS (a build killed midway) is removed, and the operators build and load."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    probe = ("from airserve.srt.layers import cpu_kernels as k; from torch.utils import "
             "cpp_extension as c; print(c._get_build_directory("
             "k.build_name(), verbose=False))")
    build_dir = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
    assert build_dir.startswith(str(tmp_path))
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    old = time.time() - cpu_kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    run = ("from airserve.srt.layers import cpu_kernels as k; import torch; "
           "from airserve.srt.layers.quant.block_matvec import PackedWeight, packed_linear; "
           "assert k.available(), k.unavailable_reason(); "
           "w = PackedWeight('q8_0', torch.ones(2, 32, dtype=torch.int8), "
           "torch.ones(2, 1, dtype=torch.half), None); "
           "assert packed_linear(torch.ones(1, 32), w).tolist() == [[32.0, 32.0]]")
    env.pop("MAX_JOBS", None)
    proc = subprocess.Popen([sys.executable, "-c", run], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    compilers = most_compilers_while(proc)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stale build lock" in stderr
    assert not os.path.exists(lock)
    # One compiler job per core (ninja alone runs more: 3 at once on 2 cores).
    assert 1 <= compilers <= len(os.sched_getaffinity(0))


def most_compilers_while(proc: subprocess.Popen, timeout: float = 600.0) -> int:
    """The most C++ compiler processes (cc1plus) under `proc` at once until it exits."""
    import psutil

    root, most, end = psutil.Process(proc.pid), 0, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        try:
            most = max(most, sum("cc1plus" in p.name() for p in root.children(recursive=True)))
        except psutil.Error:
            pass
        time.sleep(0.02)
    return most


def test_build_jobs_follow_the_cores_unless_max_jobs_is_set():
    assert cpu_kernels.build_jobs({}, cpus=2) == "2"
    assert cpu_kernels.build_jobs({}, cpus=0) == "1"
    assert cpu_kernels.build_jobs({"MAX_JOBS": "5"}, cpus=2) is None  # the user's choice
    assert cpu_kernels.build_jobs({}) == str(len(os.sched_getaffinity(0)))


def test_build_name_is_per_checkout_and_per_source(tmp_path):
    """Two checkouts must not share a build directory (torch rebuilds it in turn for each, under
    its lock, when the sources' paths change), and a changed source or included file renames it.
    """
    import shutil

    here = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    a, b = shutil.copytree(here, tmp_path / "a"), shutil.copytree(here, tmp_path / "b")
    tag = cpu_kernels._sources_tag(str(a))
    assert tag == cpu_kernels._sources_tag(str(a)) != cpu_kernels._sources_tag(str(b))
    for name in ("block_int8.cpp", "isa_select.h"):
        with open(a / name, "a") as f:
            f.write("\n")
        assert cpu_kernels._sources_tag(str(a)) != tag
        tag = cpu_kernels._sources_tag(str(a))
