"""python -m offload inspect / doctor, run as users run them."""
import errno
import json
import sys
import textwrap

import pytest
import torch

import offload
from conftest import run_python, uring_refusal


def run(*args, **kwargs):
    return run_python([sys.executable, "-m", "offload", *args], capture_output=True, text=True,
                      timeout=120, **kwargs)


def test_inspect_lists_names_dtypes_shapes_and_sizes(tmp_path):
    path = tmp_path / "m.safetensors"
    offload.save({"embed.weight": torch.zeros(100, 16), "step": torch.tensor(3, dtype=torch.int64)}, path,
                 {"epoch": "4"})
    text = run("inspect", str(path))
    assert text.returncode == 0, text.stderr
    assert "embed.weight" in text.stdout and "float32" in text.stdout and "(100, 16)" in text.stdout
    assert "6400 B" in text.stdout and "epoch = 4" in text.stdout
    data = json.loads(run("inspect", str(path), "--json").stdout)
    assert data["metadata"] == {"epoch": "4"}
    assert {t["name"]: (t["dtype"], t["shape"], t["bytes"]) for t in data["tensors"]} == {
        "embed.weight": ("float32", [100, 16], 6400), "step": ("int64", [], 8)}


def test_inspect_of_a_sharded_index_lists_every_shard_and_where_it_lives(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    index = tmp_path / "model.safetensors.index.json"
    offload.save({"a": torch.zeros(300), "b": torch.ones(200, dtype=torch.int64)}, index, {"epoch": "2"},
                 stripe=[other])
    text = run("inspect", str(index))
    assert text.returncode == 0, text.stderr
    assert "2 tensors in 2 shards" in text.stdout and str(other / "model-00002-of-00002.safetensors") in text.stdout
    data = json.loads(run("inspect", str(index), "--json").stdout)
    assert data["metadata"] == {"epoch": "2"}
    assert {t["name"]: (t["shard"], t["bytes"]) for t in data["tensors"]} == {
        "b": ("model-00001-of-00002.safetensors", 1600), "a": ("model-00002-of-00002.safetensors", 1200)}
    assert {s["location"] for s in data["shards"]} == {str(tmp_path / "model-00001-of-00002.safetensors"),
                                                       str(other / "model-00002-of-00002.safetensors")}


def test_inspect_of_an_index_names_shards_it_does_not_list(tmp_path):
    """What a save killed before its index leaves beside it (a shard under a
    name of that save) is named, and nothing else: the listed shards, another
    checkpoint's shards and other files are not."""
    index = tmp_path / "model.safetensors.index.json"
    offload.save({"a": torch.zeros(300), "b": torch.ones(200)}, index, max_shard_bytes=1024)
    for name in ("model-00001-of-00002-2.safetensors", "other-00001-of-00001.safetensors", "model.txt",
                 "model-1-of-2.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    data = json.loads(run("inspect", str(index), "--json").stdout)
    assert data["unlisted"] == ["model-00001-of-00002-2.safetensors"]
    text = run("inspect", str(index)).stdout
    assert "not in the index: model-00001-of-00002-2.safetensors" in text and "other-0000" not in text
    assert offload.checkpoint.inspect(index)["unlisted"] == ["model-00001-of-00002-2.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model-00001-of-00002-2.safetensors", "other-00001-of-00001.safetensors", "model.txt",
        "model-1-of-2.safetensors"])  # nothing removed


def test_inspect_of_a_broken_file_says_why(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("inspect", str(path))
    assert result.returncode == 1 and "bad.safetensors" in result.stderr and "JSON" in result.stderr


def test_doctor_reports_what_this_machine_does(tmp_path):
    result = run("doctor", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["io_uring"]["available"] == (uring_refusal() is None)
    assert report["auto_engine"] == ("uring" if uring_refusal() is None else "threads")
    assert report["o_direct"]["accepted"] is True and report["o_direct"]["alignment"]["offset"] > 0
    assert report["free_space"]["free_bytes"] > 0
    assert report["cuda"]["available"] == torch.cuda.is_available()
    from offload import _core
    assert report["io_uring"]["liburing_linked"] == (_core.URING_LINK or "no")
    split = report["request_splitting"]
    if split["known"]:  # read from the block queue of the device under tmp_path
        assert split["splits_small_page_requests"] == (split["max_segments"] * 4096 < split["max_sectors_kb"] * 1024)
    assert isinstance(report["memory_given_back"]["reporting"], bool)
    human = run("doctor", str(tmp_path))
    assert "io_uring" in human.stdout and "O_DIRECT" in human.stdout and "auto engine" in human.stdout
    assert "request size" in human.stdout and "linked" in human.stdout and "freed memory" in human.stdout
    assert report["buffer_pages"]["page_kib"] >= 4 and "buffer pages" in human.stdout
    assert "tensor writes" in human.stdout


def test_doctor_says_whether_torchs_tensors_are_written_through_staging_copies(tmp_path):
    """The doctor's answer for a tensor's address is what an Offloader on the
    same directory does with that tensor: staged (copied first) or not. (The
    probe is the written tensor itself: in this long-lived process a large
    one may land in a free heap region, anywhere in a page, where a fresh
    process maps it.)"""
    from offload.doctor import _o_direct, _tensor_writes
    o_direct = _o_direct(str(tmp_path))
    with offload.Offloader(tmp_path) as off:
        t = torch.empty(64 << 20, dtype=torch.uint8)
        said = _tensor_writes(o_direct, address=t.data_ptr())
        off.sync_write(t)
        assert (off.staged_bytes > 0) == said["staged"], said["reason"]
    # Both answers, whatever this machine's disk wants.
    nvme_like = {"accepted": True, "transfer_alignment": {"memory": 4, "length": 512}}
    assert not _tensor_writes(nvme_like)["staged"]
    misfit = _tensor_writes(nvme_like, nbytes=(4 << 20) + 64)
    assert misfit["staged"] and "staging blocks" in misfit["reason"]
    virtio_like = {"accepted": True, "transfer_alignment": {"memory": 512, "length": 512}}
    assert _tensor_writes(virtio_like, address=(1 << 30) + 64)["staged"]  # where glibc maps torch's tensors
    assert not _tensor_writes(virtio_like, address=1 << 30)["staged"]
    assert not _tensor_writes({"accepted": False, "reason": "EINVAL"})["staged"]


@pytest.mark.parametrize("devices, reporting", [
    ({"virtio0": ("0x0005", "0110010100000000"), "virtio1": ("0x0002", "0010001001100100")}, True),
    ({"virtio0": ("0x0002", "0000011111111111"), "virtio3": ("0x0005", "0110000000000000")}, False),
    ({"virtio0": ("0x0002", "0000011111111111")}, False),
], ids=["balloon-reporting", "balloon-without-reporting", "no-balloon"])
def test_doctor_reads_free_page_reporting_from_the_balloons_feature_bits(tmp_path, devices, reporting):
    """Bit 5 of the virtio balloon's features (VIRTIO_BALLOON_F_REPORTING),
    in sysfs's one-character-a-bit string; other devices' bits do not count."""
    from offload.doctor import free_page_reporting
    for name, (device, features) in devices.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "device").write_text(device + "\n")
        (tmp_path / name / "features").write_text(features + "0" * 48 + "\n")
    found = free_page_reporting(str(tmp_path), str(tmp_path / "no-parameters"))
    assert found["reporting"] is reporting
    assert ("OFFLOAD_HUGE_PAGES" in found["reason"]) is reporting
    assert ("THP_MEM_ALLOC_ENABLE=1" in found["reason"]) is reporting   # torch's own huge pages, per process
    assert "min_free_ms" not in found
    assert free_page_reporting(str(tmp_path / "absent"))["reporting"] is False


def test_doctor_reports_how_long_freed_memory_waits_before_the_host_takes_it(tmp_path):
    """A kernel whose page_reporting has min_free_ms: its value, and how to
    raise it; a kernel without one: nothing said of it."""
    from offload.doctor import free_page_reporting
    (tmp_path / "virtio0").mkdir()
    (tmp_path / "virtio0" / "device").write_text("0x0005\n")
    (tmp_path / "virtio0" / "features").write_text("0110010100000000" + "0" * 48 + "\n")
    (tmp_path / "parameters").mkdir()
    (tmp_path / "parameters" / "min_free_ms").write_text("0\n")
    found = free_page_reporting(str(tmp_path), str(tmp_path / "parameters"))
    assert found["min_free_ms"] == 0 and "min_free_ms = 0 ms" in found["reason"]
    assert f"echo 60000 > {tmp_path / 'parameters'}/min_free_ms" in found["reason"]
    assert "max_waiting_mib" not in found
    (tmp_path / "parameters" / "max_waiting_mib").write_text("1024\n")
    found = free_page_reporting(str(tmp_path), str(tmp_path / "parameters"))
    assert found["max_waiting_mib"] == 1024 and "max_waiting_mib = 1024 MiB" in found["reason"]
    assert f"echo 65536 > {tmp_path / 'parameters'}/max_waiting_mib" in found["reason"]
    (tmp_path / "parameters" / "min_free_ms").unlink()
    assert "min_free_ms" not in free_page_reporting(str(tmp_path), str(tmp_path / "parameters"))


def _thp_tree(root, top, sizes):
    root.mkdir()
    (root / "enabled").write_text(" ".join(f"[{w}]" if w == top else w for w in ("always", "madvise", "never")) + "\n")
    for kib, setting in sizes.items():
        (root / f"hugepages-{kib}kB").mkdir()
        words = ("always", "inherit", "madvise", "never")
        (root / f"hugepages-{kib}kB" / "enabled").write_text(
            " ".join(f"[{w}]" if w == setting else w for w in words) + "\n")
    return str(root)


@pytest.mark.parametrize("top, sizes, page_kib", [
    ("madvise", {2048: "inherit", 256: "never", 64: "never"}, 2048),     # the kernel's default
    ("madvise", {2048: "never", 256: "madvise", 64: "always"}, 256),     # 2 MiB off, smaller sizes on
    ("never", {2048: "inherit", 256: "never"}, 4),                       # inherits "never": base pages
    ("always", {}, 2048),                                                # a kernel without multi-size THP
    ("never", {}, 4),
], ids=["default", "mthp", "all-off", "single-size", "single-size-off"])
def test_doctor_says_which_pages_new_buffers_fault_in_on(tmp_path, top, sizes, page_kib):
    """The largest THP size enabled for madvised memory (the pool advises
    MADV_HUGEPAGE); on a VM that hands freed memory back, 2 MiB pages get
    the advice to use a smaller size, and nothing else does."""
    from offload.doctor import _buffer_pages
    thp = _thp_tree(tmp_path / "thp", top, sizes)
    for given_back in (False, True):
        found = _buffer_pages(given_back, thp)
        assert found["page_kib"] == page_kib, found
        assert found["slow_first_touch"] is (given_back and page_kib == 2048)
        advised = "hugepages-256kB/enabled" in found["reason"]
        assert advised is (found["slow_first_touch"] and 256 in sizes)   # only where the kernel has the size
    assert _buffer_pages(True, str(tmp_path / "absent"))["page_kib"] == 4


DOCTOR_UNDER_SECCOMP = textwrap.dedent("""
    import ctypes, sys
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    ctx = ctypes.c_void_p(lib.seccomp_init(ctypes.c_uint32(0x7FFF0000)))
    nr = lib.seccomp_syscall_resolve_name(b"io_uring_setup")
    assert lib.seccomp_rule_add(ctx, ctypes.c_uint32(0x00050000 | int(sys.argv[2])), nr, 0) == 0
    assert lib.seccomp_load(ctx) == 0
    from offload.doctor import main
    sys.exit(main([sys.argv[1], "--json"]))
""")


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOSYS])
def test_doctor_explains_a_blocked_io_uring(tmp_path, code):
    import ctypes.util
    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("libseccomp is not installed")
    result = run_python([sys.executable, "-c", DOCTOR_UNDER_SECCOMP, str(tmp_path), str(code)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["io_uring"]["available"] is False
    assert report["io_uring"]["errno"] == errno.errorcode[code]
    assert errno.errorcode[code] in report["io_uring"]["reason"]
    assert report["auto_engine"] == "threads"


def test_usage_lists_the_commands():
    result = run()
    assert result.returncode == 2
    assert all(name in result.stdout for name in ("bench", "inspect", "doctor"))
