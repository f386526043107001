"""The pool on the system's reserved huge pages (OFFLOAD_HUGE_PAGES): which
blocks come from them, that the limit and the reserve are respected, that
they go back to the reserve, and that data read into them is the data
written. Reserving pages needs root (CI runs as root); elsewhere these skip."""
import os
import sys
import textwrap

import pytest

from offload import _core
from offload._pool import huge_page_limit
from conftest import run_python

# Reserved huge pages: no fio or other such test beside these (conftest.py).
pytestmark = pytest.mark.usefixtures("module_huge_pages")

MIB = 1 << 20
HUGE = 2 * MIB
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


def free_huge_pages() -> int:
    """Reserved huge pages no mapping has claimed: free and not promised to
    a mapping that has yet to touch them."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.split()[0]
    return int(fields.get("HugePages_Free", 0)) - int(fields.get("HugePages_Rsvd", 0))


@pytest.fixture
def reserve():
    """reserve(pages): makes exactly ``pages`` huge pages free and reserved
    for this test; the reserve in place before is restored afterwards."""
    if os.geteuid() != 0 or not os.path.exists(NR_HUGEPAGES):
        pytest.skip("reserving huge pages needs root")
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())

    def make(pages):
        total = before - free_huge_pages() + pages   # pages others hold stay theirs
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(total))
        if free_huge_pages() < pages:
            pytest.skip(f"the kernel would not reserve {pages} huge pages")
    yield make
    with open(NR_HUGEPAGES, "w") as f:
        f.write(str(before))


def hugetlb_kib(address: int) -> int:
    """Private_Hugetlb of the mapping holding ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Private_Hugetlb:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_without_a_limit_the_pool_leaves_reserved_pages_alone(reserve):
    reserve(4)
    pool = _core.BufferPool(64 * MIB)
    block = pool.acquire(HUGE)
    memoryview(block)[:] = b"\1" * HUGE
    assert pool.huge_page_bytes == 0 and free_huge_pages() == 4
    assert hugetlb_kib(block.address) == 0


def test_blocks_come_from_reserved_pages_up_to_the_limit(reserve):
    reserve(8)
    pool = _core.BufferPool(64 * MIB)
    pool.set_huge_page_limit(3 * HUGE)
    big = pool.acquire(3 * MIB)          # rounded up to two huge pages
    small = pool.acquire(64 << 10)       # carved out of a slab: the third
    beyond = pool.acquire(HUGE)          # the limit is reached: ordinary memory
    for b in (big, small, beyond):
        memoryview(b)[:] = b"\7" * b.capacity
    assert pool.huge_page_bytes == 3 * HUGE
    assert free_huge_pages() == 8 - 3
    assert hugetlb_kib(big.address) == 4096 and hugetlb_kib(small.address) == 2048
    assert hugetlb_kib(beyond.address) == 0
    assert all(bytes(memoryview(b)[:16]) == b"\7" * 16 for b in (big, small, beyond))


def test_an_exhausted_reserve_falls_back_to_ordinary_memory(reserve):
    reserve(1)
    pool = _core.BufferPool(64 * MIB)
    pool.set_huge_page_limit(1 << 40)
    first, second = pool.acquire(HUGE), pool.acquire(HUGE)
    assert pool.huge_page_bytes == HUGE and free_huge_pages() == 0
    for b in (first, second):
        memoryview(b)[:] = b"\3" * HUGE       # both usable: no SIGBUS
    assert hugetlb_kib(first.address) == 2048 and hugetlb_kib(second.address) == 0


def test_reserved_blocks_are_recycled_never_lazily_freed_and_trim_returns_them(reserve):
    reserve(4)
    pool = _core.BufferPool(0, 64 * MIB)       # every released block leaves the idle cache
    pool.set_huge_page_limit(1 << 40)
    block = pool.acquire(2 * HUGE)
    assert free_huge_pages() == 2
    del block                                  # not lazily freed (the kernel cannot reclaim it): unmapped
    assert pool.lazy_bytes == 0 and pool.huge_page_bytes == 0 and free_huge_pages() == 4
    kept = _core.BufferPool(64 * MIB)
    kept.set_huge_page_limit(1 << 40)
    block = kept.acquire(2 * HUGE)
    address = block.address
    del block
    assert kept.idle_bytes == 2 * HUGE and free_huge_pages() == 2
    again = kept.acquire(2 * HUGE)             # a cache hit: the same reserved pages
    assert again.address == address and kept.hits == 1
    del again
    kept.trim()
    assert kept.huge_page_bytes == 0 and free_huge_pages() == 4


FRESH_PROCESS = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload import buffer_pool
    MIB = 1 << 20
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
               for n in (16 * MIB, 16 * MIB, MIB, 3 * MIB + 4096, 64 << 10)]
    expected = [t.clone() for t in tensors]
    with Offloader(sys.argv[1], backend=sys.argv[2]) as off:
        off.sync_writev(tensors)
        off.sync_readv(tensors)
        same = all(torch.equal(a, b) for a, b in zip(tensors, expected))
        address = tensors[0].data_ptr()
        with open("/proc/self/smaps") as f:   # the mapping the first tensor's data lies in
            lines = f.read().splitlines()
        starts = [i for i, l in enumerate(lines) if l and "-" in l.split()[0] and not l.split()[0].endswith(":")]
        hugetlb = 0
        for i in starts:
            start, end = (int(x, 16) for x in lines[i].split()[0].split("-"))
            if start <= address < end:
                hugetlb = next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Private_Hugetlb:"))
        print(buffer_pool().huge_page_bytes // MIB, hugetlb, same)
""")


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_fresh_process_reads_into_reserved_pages_when_told_to(reserve, tmp_path, backend):
    reserve(40)
    env = dict(os.environ, OFFLOAD_HUGE_PAGES="all")
    result = run_python([sys.executable, "-c", FRESH_PROCESS, str(tmp_path), backend],
                        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    huge_mib, tensor_hugetlb_kib, same = result.stdout.split()
    assert same == "True"
    assert int(huge_mib) >= 36, huge_mib    # the read blocks at least; staging blocks too
    assert int(tensor_hugetlb_kib) >= 16 << 10    # the read tensor's memory is reserved pages
    assert free_huge_pages() == 40          # all given back at exit


def test_the_setting_is_parsed_strictly():
    assert huge_page_limit("") == huge_page_limit("0") == 0
    assert huge_page_limit("4G") == 4 << 30 and huge_page_limit("512m") == 512 << 20
    assert huge_page_limit("1.5K") == 1536 and huge_page_limit("65536") == 65536
    assert huge_page_limit("all") >= 1 << 60
    for bad in ("lots", "-1G", "4GB"):
        with pytest.raises(ValueError, match="OFFLOAD_HUGE_PAGES"):
            huge_page_limit(bad)


def test_doctor_says_whether_the_pool_may_take_the_reserved_pages(reserve, tmp_path):
    import json
    reserve(4)

    def doctor(setting):
        env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_HUGE_PAGES"}
        if setting is not None:
            env["OFFLOAD_HUGE_PAGES"] = setting
        result = run_python([sys.executable, "-m", "offload", "doctor", str(tmp_path), "--json"],
                            capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["huge_pages"]
    left_alone = doctor(None)
    assert left_alone["free"] == 4 and left_alone["pool_limit"] == 0
    assert "leaves them alone" in left_alone["reason"]
    taken = doctor("8M")
    assert taken["pool_limit"] == 8 << 20 and "may take 8 MiB" in taken["reason"]
    assert "invalid" in doctor("plenty")["setting"]


LOAD_PROCESS = textwrap.dedent("""
    import sys, torch, offload
    MIB = 1 << 20
    gen = torch.Generator().manual_seed(12)
    sd = {f"t{i}": torch.randint(0, 256, (40 * MIB + 12288,), dtype=torch.uint8, generator=gen) for i in range(4)}
    path = sys.argv[1] + "/m.safetensors"
    offload.save(sd, path)
    loaded = offload.load(path)   # 160 MiB: segments after the first are faulted in by a helper thread
    print(offload.buffer_pool().huge_page_bytes // MIB, all(torch.equal(loaded[k], sd[k]) for k in sd))
""")


def test_a_checkpoint_loads_into_reserved_pages(reserve, tmp_path):
    """The loader faults fresh buffers in on a helper thread, advised onto
    4 KiB pages; the kernel refuses that advice (EINVAL) for a reserved
    huge-page buffer whose length is not a whole number of huge pages, and
    the load must go on (it hung: the helper thread died on the refusal)."""
    reserve(300)  # the save's staging ring (128 MiB) and the load's buffers (160 MiB)
    env = dict(os.environ, OFFLOAD_HUGE_PAGES="all")
    result = run_python([sys.executable, "-c", LOAD_PROCESS, str(tmp_path)], env=env, capture_output=True,
                        text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    huge_mib, same = result.stdout.split()
    assert int(huge_mib) >= 128 + 160 and same == "True"
