"""The ps ranks' heap (mpisync.runtime.heap): large blocks served from the heap and kept there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi_helpers import assert_init_refuses_switch

# In a process of its own (the setting is process-wide): a 40 MB tensor, made and freed
# three times as an optimizer's temporary is each step; glibc's counters tell where it
# lived (hblks: blocks mapped with mmap, counted before and with it) and how much the
# heap holds (arena); the resident set (Linux's /proc/self/statm) what release() gave back
# (malloc_trim returns free pages inside the heap too, where a block above them keeps
# the heap's top, and arena, where they were).
PRELUDE = r"""
import ctypes, json, os, time, torch
from mpisync.runtime import heap

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
"""
PROBE = PRELUDE + r"""
kept = heap.keep()
mapped, held = [], []
for _ in range(3):
    before = libc.mallinfo2().hblks
    t = torch.ones(10 * 1024 * 1024)
    mapped.append(libc.mallinfo2().hblks - before)
    del t
    held.append(libc.mallinfo2().arena)
before = resident()
heap.release()
print(json.dumps({"kept": kept, "again": heap.keep(), "mapped": mapped, "held": held,
                  "released": before - resident()}))
"""


def _probe(**env) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **env), check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def glibc():
    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc: mpisync leaves the C library's malloc alone")


def test_kept_heap_serves_large_blocks_without_mmap_and_keeps_them(glibc):
    got = _probe(MPISYNC_KEEP_HEAP="")
    assert got["kept"] and got["again"], got
    assert got["mapped"] == [0, 0, 0], got              # never a fresh mapping
    assert min(got["held"]) >= 40 * 1024 * 1024, got      # freed, still the heap's
    assert got["released"] >= 40 * 1024 * 1024, got     # release(): back to the kernel


def test_keep_heap_off_leaves_glibcs_defaults(glibc):
    got = _probe(MPISYNC_KEEP_HEAP="0")
    assert not got["kept"] and not got["again"], got
    assert got["mapped"][0] == 1, got                     # glibc maps a first 40 MB block


@pytest.mark.parametrize("users", [{"MALLOC_MMAP_THRESHOLD_": "65536"},
                                   {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}],
                         ids=["MALLOC_", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_settings_win(glibc, users):
    got = _probe(MPISYNC_KEEP_HEAP="", **users)
    assert not got["kept"] and not got["again"], got


# A worker's setting: a 4 MB block (a step's pooled sums or their gradient) made and freed
# three times is never mapped and stays the heap's; a 64 MB one is mapped and goes back to
# the kernel when freed, as without the setting; 96 MB freed before the first step go
# back at its tidy(), the only one; after the last optimizer closes (let_go) 4 MB blocks
# beyond what the heap holds free are mapped again, as by glibc before any large free.
STEPS = PRELUDE + r"""
kept = heap.keep_steps()
mapped, held = [], []
for _ in range(3):
    before = libc.mallinfo2().hblks
    t = torch.ones(1024 * 1024)
    mapped.append(libc.mallinfo2().hblks - before)
    del t
    held.append(libc.mallinfo2().arena)
before = libc.mallinfo2().hblks
big = torch.ones(16 * 1024 * 1024)
large = libc.mallinfo2().hblks - before
with_big = resident()
del big
gone = with_big - resident()
pieces = [torch.ones(2 * 1024 * 1024) for _ in range(12)]   # 96 MB in 8 MB blocks, freed
del pieces                                                 # before the first step
before = resident()
first = heap.tidy()
freed = before - resident()
again = heap.tidy()                 # the first step's only
second = heap.keep_steps()          # a second optimizer trains, then both close
heap.let_go()
still = heap.in_force()
heap.let_go()
before = libc.mallinfo2().hblks
after_close = [torch.ones(1024 * 1024) for _ in range(64)]  # 256 MB in 4 MB blocks: past
                                                            # the heap's free ones, mapped
print(json.dumps({"kept": kept, "in_force": still, "mapped": mapped, "held": held,
                  "large": large, "gone": gone, "first": first,
                  "freed": freed, "again": again, "second": second,
                  "let_go": libc.mallinfo2().hblks - before, "after": heap.in_force()}))
"""


def _steps(**env) -> dict:
    run = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **env), check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_workers_heap_keeps_a_steps_blocks_and_maps_large_ones(glibc):
    got = _steps(MPISYNC_KEEP_HEAP="")
    assert got["kept"] and got["in_force"] == "steps", got
    assert got["mapped"] == [0, 0, 0], got               # never a fresh mapping
    assert min(got["held"]) >= 4 * 1024 * 1024, got        # freed, still the heap's
    assert got["large"] == 1 and got["gone"] >= 60 * 1024 * 1024, got   # as glibc does
    # tidy(): at the first step, what was freed before goes back to the kernel; once
    assert got["first"] and got["freed"] >= 90 * 1024 * 1024, got
    assert not got["again"], got
    # the last optimizer's close (let_go): the setting ends, glibc's first thresholds
    assert got["second"] and got["in_force"] == "steps" and got["after"] is None, got
    assert got["let_go"] >= 10, got


@pytest.mark.parametrize("env", [{"MPISYNC_KEEP_HEAP": "0"},
                                 {"MPISYNC_KEEP_HEAP": "", "MALLOC_TRIM_THRESHOLD_": "1"}],
                         ids=["off", "users-own"])
def test_a_workers_heap_left_alone(glibc, env):
    got = _steps(**env)
    assert not got["kept"] and got["in_force"] is None and not got["first"], got
    assert got["after"] is None and not got["second"], got
    assert got["mapped"][0] == 1, got                      # glibc maps a first 4 MB block


def test_keep_heap_refuses_a_malformed_switch(glibc):
    run = subprocess.run([sys.executable, "-c", "from mpisync.runtime import heap; heap.keep()"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, MPISYNC_KEEP_HEAP="yes"))
    assert run.returncode != 0
    assert "MPISYNC_KEEP_HEAP='yes' is not 1 (on) or 0 (off)" in run.stderr, run.stderr[-2000:]


def test_init_refuses_a_malformed_switch_on_every_rank(glibc):
    """``mpisync.init()`` reads the switch on every rank (workers included), so that a bad
    value ends every rank alike at once, not the ps ranks alone when they start to serve
    while the workers wait for them."""
    assert "serve" not in assert_init_refuses_switch("MPISYNC_KEEP_HEAP")


# torch's Adagrad makes its sums when built, in the heap; a ps rank moves a shard's into
# the memory its shards live in (madvised for huge pages: "hg" among the mapping's
# VmFlags), and the heap's copy goes back to the kernel.
PLACE = r"""
import json, os, torch
from mpisync.native import kernels
from mpisync.runtime import heap
from mpisync.ps.rowunits import place as _place

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def advised(address):
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False

heap.keep()
shard = torch.nn.Parameter(kernels.table_zeros((1 << 17, 16), torch.float32))
opt = torch.optim.Adagrad([shard], initial_accumulator_value=0.25)
state = opt.state[shard]
state["other"] = torch.ones(3)
old = state["sum"].data_ptr()
moved = _place(state, shard.shape)
before = resident()                # the heap still holds the sums it made
heap.release()
print(json.dumps({"moved": moved, "new": state["sum"].data_ptr() != old,
                  "values": bool((state["sum"] == 0.25).all()),
                  "advised": advised(state["sum"].data_ptr()),
                  "shard_advised": advised(shard.data_ptr()),
                  "released": before - resident(), "step": float(state["step"]),
                  "other": state["other"].tolist(),
                  "none": _place({"step": torch.tensor(0.0)}, shard.shape)}))
"""


def test_a_shards_optimizer_state_moves_into_the_shards_memory(glibc):
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps to read the mappings from")
    run = subprocess.run([sys.executable, "-c", PLACE], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["moved"] and got["new"] and got["values"], got
    assert got["advised"] == got["shard_advised"] is True, got
    assert got["released"] >= 2 << 20, got    # of the 8 MiB of sums the heap held: 4-8 MiB
    assert got["step"] == 0.0 and got["other"] == [1.0, 1.0, 1.0] and not got["none"], got
