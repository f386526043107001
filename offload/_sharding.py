"""Sharded checkpoints in Hugging Face's layout (``<prefix>.safetensors.index.json``
beside ``<prefix>-00001-of-0000N.safetensors`` files), spread over several
directories: which tensors go to which shard, where each shard lives, how
the index reaches shards in other directories (a symlink beside the index),
and what a save leaves behind when it replaces an older checkpoint."""
import heapq
import json
import os
import re
import secrets

from ._atomic_file import AtomicFile, unlink_later
from ._safetensors import CheckpointError

INDEX_SUFFIX = ".index.json"


def plan(named, directories: int, max_shard_bytes) -> list:
    """``named`` ((name, tensor) pairs in storage order) split into shards:
    a list of lists, shard ``i`` destined for directory ``i % directories``.
    As many shards as directories (a multiple of it when ``max_shard_bytes``
    asks for more), at most one per tensor; tensors go, largest first, to
    the shard with the fewest bytes so far, so every directory gets about
    the same share of the bytes; each shard keeps the tensors' order."""
    if not named:
        return []
    nbytes = [t.numel() * t.element_size() for _, t in named]
    count = directories
    if max_shard_bytes:
        count = max(count, -(-sum(nbytes) // max_shard_bytes))
        count = -(-count // directories) * directories
    count = min(count, len(named))
    shards, lightest = [[] for _ in range(count)], [(0, j) for j in range(count)]  # a heap of (bytes, shard)
    for i in sorted(range(len(named)), key=lambda i: -nbytes[i]):
        size, j = heapq.heappop(lightest)
        shards[j].append(i)
        heapq.heappush(lightest, (size + nbytes[i], j))
    return [[named[i] for i in sorted(indices)] for indices in shards]


def shard_names(prefix: str, count: int, directories) -> list:
    """Hugging Face's shard names, ``<prefix>-0000i-of-0000N.safetensors``,
    with ``-2``, ``-3``... before the extension where any of them exists
    already in any of ``directories``: a save never overwrites a shard, so
    the index it replaces still finds every one of its own until the new
    index takes its place."""
    generation = 1
    while True:
        tag = "" if generation == 1 else f"-{generation}"
        names = [f"{prefix}-{i + 1:05d}-of-{count:05d}{tag}.safetensors" for i in range(count)]
        if not any(os.path.lexists(os.path.join(d, n)) for d in directories for n in names):
            return names
        generation += 1


def prefix_of(index_path: str) -> str:
    """``model`` for ``model.safetensors.index.json`` (Hugging Face's names)."""
    base = os.path.basename(index_path)[:-len(INDEX_SUFFIX)]
    return base[:-len(".safetensors")] if base.endswith(".safetensors") else base


def old_shards(index_path: str) -> set:
    """The shard names the index at ``index_path`` lists now (none when
    there is no index, or it cannot be read)."""
    try:
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        return {v for v in weight_map.values() if isinstance(v, str) and os.path.basename(v) == v}
    except (OSError, ValueError, AttributeError):
        return set()


def unlisted_shards(index_path: str) -> list:
    """Files (or links) beside the index named as its shards are
    (``<prefix>-0000i-of-0000N[-g].safetensors``) that the index does not
    list: what a save that did not finish (a crash, SIGKILL) can leave. Only
    the index's directory is looked at: a stripe directory may hold another
    checkpoint's shards under the same names, so nothing is ever removed by
    name alone."""
    directory = os.path.dirname(os.path.abspath(index_path))
    pattern = re.compile(re.escape(prefix_of(index_path)) + r"-\d{5}-of-\d{5}(-\d+)?\.safetensors")
    listed = old_shards(index_path)
    return sorted(name for name in os.listdir(directory) if pattern.fullmatch(name) and name not in listed)


def link(index_dir: str, name: str, target: str) -> str:
    """A symlink ``index_dir/name`` -> ``target`` (absolute), made under a
    temporary name and renamed into place; returns its path."""
    path = os.path.join(index_dir, name)
    temp = os.path.join(index_dir, f".{name}.link-{secrets.token_hex(6)}")
    os.symlink(os.path.realpath(target), temp)
    try:
        os.rename(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    return path


def write_index(path: str, weight_map: dict, total_size: int) -> None:
    """The index, replacing any older one atomically (fsynced, renamed,
    directory fsynced): the moment the new checkpoint takes the old one's
    place."""
    document = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    data = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
    target = AtomicFile(path, direct=False)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(target.fd, view):]
        target.commit()
    except BaseException:
        target.abort()
        raise


def remove(index_dir: str, names) -> None:
    """Removes shards by name from ``index_dir``, best effort; a symlink that
    a save made (its target has the link's name) goes with its target."""
    for name in names:
        path = os.path.join(index_dir, name)
        target = link_target(path)
        if target is not None and os.path.basename(target) == name:
            unlink_later(target)
        unlink_later(path)


def link_target(path: str):
    """Where the symlink ``path`` leads (None: not a symlink)."""
    return os.path.realpath(path) if os.path.islink(path) else None


def load_groups(shards) -> list:
    """``shards`` ((file, names) pairs) grouped by the file system each file
    lives on (symlinks followed), in first-seen order: groups load at once,
    the shards of one group one after another."""
    groups = {}
    for shard in shards:
        try:
            device = os.stat(shard[0]).st_dev
        except OSError:
            device = None  # (the load names the missing file)
        groups.setdefault(device, []).append(shard)
    return list(groups.values())


def check_directories(index_path: str, stripe) -> list:
    """The directories of a sharded save, the index's first; each must exist."""
    first = os.path.dirname(os.path.abspath(index_path))
    if not os.path.isdir(first):
        raise CheckpointError(f"{first}: no such directory (a sharded save writes into existing directories)")
    return [first] + stripe_directories(first, stripe)


def stripe_directories(first: str, stripe) -> list:
    """``stripe`` as absolute paths, checked: existing directories, none
    listed twice or the same as ``first`` (the checkpoint's own). Raises
    ValueError for a ``stripe`` that is not a list of paths."""
    if isinstance(stripe, (str, bytes, os.PathLike)):
        raise ValueError("stripe= takes a list of directories")
    directories = [os.path.abspath(os.fspath(first))]
    for d in stripe:
        d = os.path.abspath(os.fspath(d))
        if any(os.path.realpath(d) == os.path.realpath(e) for e in directories):
            raise ValueError(f"{d} is listed twice among the checkpoint's directories")
        if not os.path.isdir(d):
            raise CheckpointError(f"{d}: no such directory (a striped save writes into existing directories)")
        directories.append(d)
    return directories[1:]
