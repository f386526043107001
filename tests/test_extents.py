import random

from offload._extents import ExtentAllocator

A = 4096


def test_sizes_round_up_to_the_alignment():
    e = ExtentAllocator(A)
    assert e.round_up(1) == A and e.round_up(A) == A and e.round_up(A + 1) == 2 * A


def test_freed_extents_are_reused_and_the_end_shrinks():
    e = ExtentAllocator(A)
    a, b, c = e.allocate(A), e.allocate(2 * A), e.allocate(A)
    assert (a, b, c) == (0, A, 3 * A) and e.end == 4 * A
    e.free(b, 2 * A)
    assert e.allocate(2 * A) == b          # exact fit
    e.free(b, 2 * A)
    assert e.allocate(A) == b              # split of a larger hole
    assert e.allocate(A) == b + A
    e.free(c, A)
    assert e.end == 3 * A                  # freeing the last extent shrinks the file end


def test_the_smallest_hole_that_fits_is_split_first():
    e = ExtentAllocator(A)
    _, b, _, d = e.allocate(A), e.allocate(4 * A), e.allocate(A), e.allocate(2 * A)
    e.allocate(A)  # keeps the end in place
    e.free(b, 4 * A)
    e.free(d, 2 * A)
    assert e.allocate(A) == d              # the 2-block hole, not the 4-block one
    assert e.allocate(4 * A) == b          # which stays whole for a tensor that needs it


def test_neighbours_coalesce():
    e = ExtentAllocator(A)
    offsets = [e.allocate(A) for _ in range(4)]
    e.allocate(A)  # keeps the end in place
    e.free(offsets[0], A)
    e.free(offsets[2], A)
    e.free(offsets[1], A)
    assert e.free_bytes == 3 * A
    assert e.allocate(3 * A) == 0


def test_random_workload_never_overlaps_and_frees_everything():
    rng = random.Random(3)
    e = ExtentAllocator(A)
    live = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            start = rng.choice(list(live))
            e.free(start, live.pop(start))
        else:
            size = A * rng.randint(1, 64)
            start = e.allocate(size)
            for other, other_size in live.items():
                assert start + size <= other or other + other_size <= start
            live[start] = size
    for start, size in list(live.items()):
        e.free(start, size)
    assert e.end == 0 and e.free_bytes == 0
