"""The sharded build: every rank of a team tokenizes its own shard, one rank merges the pieces in order.

A team is the set of ranks that share one cache directory: every rank of every node when the
directory is on a filesystem they all see, else the ranks of one node (`BuildTeam.discover`). The
sources are cut into as many shards as the team has ranks, at equal byte offsets of the corpus
(JSONL files at the next line start; a text file, or a Hugging Face dataset, is never cut), so
each rank reads about 1/N of the bytes. A rank writes its shard's piece (the kind's arrays and
counts) into `<key>.pieces-<scope><N>/<shard>/`, finished by `done.json` with the checksums of its
files; the team's rank 0 waits for every piece, verifies it (a damaged or missing one is rebuilt
there, with a warning), concatenates them in shard order and finishes the entry as a one-process
build does, so the entry is byte-identical to it (tests/data/test_sharded_build.py). A rank that
fails writes the failure marker naming its shard; every other rank polls it, while building and
while waiting, and stops with that message. Coordination is the filesystem only: a long build
would outlast a process group's timeout, and the group may not exist yet.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ddptrain.data.cache import TokenWriter, _wait_for, array_digest, build_or_wait, damaged_file, _read_meta
from ddptrain.data.sources import DataError
from ddptrain.distributed import env_local_world_size
from ddptrain.fsutil import rename

log = logging.getLogger(__name__)

_DONE = "done.json"


@dataclass(frozen=True)
class BuildTeam:
    """The ranks that share one preprocessing build, and this rank's place among them."""

    index: int  # this rank's place; 0 merges the pieces
    size: int
    node_ranks: int  # members on this node: they share its cores
    scope: str  # names the pieces directory: "" when every node shares it, else "<host>-"
    launch: str  # names this launch's failure marker

    @classmethod
    def from_env(cls, local_rank: int | None = None) -> "BuildTeam":
        """The ranks of this node (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE): right on a node-local cache
        directory and on a shared one alike (nodes then race for the entry; the rename keeps one)."""
        index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        size = env_local_world_size() if index < env_local_world_size() else index + 1
        host = socket.gethostname()
        return cls(index, size, size, f"{host}-", f"{host}-{os.getppid()}-{_attempt()}-{_started(os.getppid())}")

    @classmethod
    def discover(cls, cache_dir: Path, local_rank: int) -> "BuildTeam":
        """Collective (every rank calls it at the same point): every rank of the launch when every
        node's local rank 0 sees the files the others wrote into `cache_dir`, else this node's ranks.
        Without a process group: `from_env`."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls.from_env(local_rank)
        from ddptrain.distributed import background_group

        group = background_group()  # gloo: host objects whatever the training backend
        host, probe = socket.gethostname(), None
        if local_rank == 0:
            cache_dir.mkdir(parents=True, exist_ok=True)
            probe = cache_dir / f".probe-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_text(host)
        mine = (host, local_rank, None if probe is None else probe.name, f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine, group=group)
        sees_all = all((cache_dir / name).is_file() for _, _, name, _ in ranks if name) if probe else True
        verdicts: list = [None] * len(ranks)
        dist.all_gather_object(verdicts, sees_all, group=group)
        if probe is not None:
            probe.unlink(missing_ok=True)
        rank = dist.get_rank()
        node = [r for r, (h, *_) in enumerate(ranks) if h == host]
        if all(verdicts):
            return cls(rank, len(ranks), len(node), "", ranks[0][3])
        return cls(node.index(rank), len(node), len(node), f"{host}-", ranks[node[0]][3])

    def failure_marker(self, cache_dir: Path, key: str) -> Path:
        """Where a failed build of `key` says so to the team: named after this launch, so a marker of an
        earlier launch never fails this one (cache.remove_stale_builds deletes those of dead launchers)."""
        return cache_dir / f"{key}.failed-{self.launch}"

    def threads(self) -> int:
        """This rank's share of the node's cores, for its tokenizer's thread pool."""
        return max(1, len(os.sched_getaffinity(0)) // max(1, self.node_ranks))


def _started(pid: int) -> str:
    """When process `pid` started (clock ticks since boot): with the pid, names one process for good."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def _attempt() -> str:
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


@dataclass(frozen=True)
class Segment:
    """A run of documents of one source: a whole file (or a Hugging Face dataset: all its files), or
    the lines in bytes [start, end) of a JSONL file."""

    paths: tuple[str, ...]
    validation: bool  # from data.val_paths
    start: int = 0
    end: int | None = None  # None: to the end


@dataclass(frozen=True)
class Unit:
    """What the planner cuts: a source file (or a dataset) and whether it may be cut at line starts."""

    paths: tuple[str, ...]
    validation: bool
    size: int
    cuttable: bool


def plan_shards(units: list[Unit], count: int) -> list[list[Segment]]:
    """`count` shards, contiguous in the order of `units`, each holding about 1/count of the bytes.

    Shard k starts at the first line start at or after byte ceil(k * total / count) of the corpus
    (the units laid end to end); a unit that cannot be cut goes whole to the shard of its middle byte.
    Every rank computes the same plan: it depends only on the files."""
    total = sum(unit.size for unit in units)
    shards: list[list[Segment]] = [[] for _ in range(count)]

    def shard_of(position: int) -> int:
        return min(count - 1, position * count // total) if total else 0

    position = 0
    for unit in units:
        if not unit.cuttable or unit.size == 0:
            shards[shard_of(position + unit.size // 2)].append(Segment(unit.paths, unit.validation))
        else:
            cuts = [0]
            for k in range(1, count):
                boundary = -(-k * total // count) - position
                if 0 < boundary < unit.size:
                    cut = next_line_start(Path(unit.paths[0]), boundary)
                    if cuts[-1] < cut < unit.size:
                        cuts.append(cut)
            cuts.append(unit.size)
            for begin, end in zip(cuts[:-1], cuts[1:]):
                shards[shard_of(position + begin)].append(Segment(unit.paths, unit.validation, begin,
                                                                  None if end == unit.size else end))
        position += unit.size
    return shards


def next_line_start(path: Path, offset: int) -> int:
    """The first byte offset >= `offset` that starts a line (or the file's size)."""
    with open(path, "rb") as handle:
        handle.seek(offset - 1)
        return offset - 1 + len(handle.readline())


def describe(segments: list[Segment]) -> str:
    """A shard in words, for logs and error messages."""
    if not segments:
        return "no data"
    parts = []
    for segment in segments:
        name = segment.paths[0] + (f" (+{len(segment.paths) - 1} files)" if len(segment.paths) > 1 else "")
        if segment.start or segment.end is not None:
            name += f" bytes {segment.start}..{'end' if segment.end is None else segment.end}"
        parts.append(name)
    return ", ".join(parts) if len(parts) <= 3 else f"{parts[0]} ... {parts[-1]} ({len(parts)} parts)"


class Stopped:
    """Polls the team's failure marker (at most every `every_s`): a rank still building stops with
    the message of the rank that failed, instead of finishing a build nobody will use."""

    def __init__(self, marker: Path, every_s: float = 1.0):
        self.marker, self.every_s, self._last = marker, every_s, 0.0

    def __call__(self) -> None:
        if time.monotonic() - self._last < self.every_s:
            return
        self._last = time.monotonic()
        if self.marker.is_file():
            raise DataError(f"preprocessing failed on another rank: {self.marker.read_text()}")


def sharded_build(cache_dir: Path, key: str, team: BuildTeam, shards: list[list[Segment]],
                  build_piece: Callable[[Path, list[Segment], Callable[[], None]], dict],
                  merge: Callable[[Path, list[Path]], dict], poll_s: float = 0.5) -> tuple[Path, dict, bool]:
    """(entry dir, its meta, whether this rank merged it): this rank builds the pieces of the shards it
    owns (shard k belongs to team member k mod size), the team's rank 0 merges them.

    `build_piece(dir, segments, check)` writes a piece's files into `dir` and returns its counts
    (JSON); `check()` raises when another rank failed. `merge(tmp, piece_dirs)` writes the entry."""
    entry = cache_dir / key
    meta_file = entry / "meta.json"
    if meta_file.is_file() and damaged_file(entry, _read_meta(entry)) is None:
        return entry, _read_meta(entry), False
    cache_dir.mkdir(parents=True, exist_ok=True)
    failed = team.failure_marker(cache_dir, key)
    pieces = cache_dir / f"{key}.pieces-{team.scope}{len(shards)}"
    stopped = Stopped(failed)
    mine = range(team.index, len(shards), team.size)
    for shard in mine:
        try:
            _ensure_piece(pieces, shard, shards[shard], build_piece, stopped, team)
        except BaseException as error:
            _fail(failed, error, team, shard, shards[shard], poll_s)
            raise
    if team.index != 0:
        return entry, _wait_for(entry, failed, poll_s, damaged=True), False

    def build(tmp: Path) -> dict:
        dirs = _wait_for_pieces(pieces, shards, failed, poll_s)
        for shard, segments in enumerate(shards):  # verified before merging: rebuilt here if damaged
            damage = _piece_damage(dirs[shard], segments)
            if damage is not None:
                log.warning("data: piece of shard %d (%s) is damaged (%s): rebuilt", shard, describe(segments), damage)
                shutil.rmtree(dirs[shard], ignore_errors=True)
                _ensure_piece(pieces, shard, segments, build_piece, stopped, team)
        _log_shares(dirs, shards)
        return merge(tmp, dirs)

    result = build_or_wait(cache_dir, key, build, is_builder=True, poll_s=poll_s, failed=failed)
    for stale in cache_dir.glob(f"{key}.pieces-{team.scope}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return result


def _ensure_piece(pieces: Path, shard: int, segments: list[Segment], build_piece, check, team: BuildTeam) -> None:
    """The piece of `shard`, reused when an earlier attempt finished it and it verifies, else built."""
    final = pieces / str(shard)
    if final.is_dir():
        damage = _piece_damage(final, segments)
        if damage is None:
            log.info("data: reusing the piece of shard %d (%s)", shard, describe(segments))
            return
        log.warning("data: piece of shard %d (%s) is damaged (%s): rebuilt", shard, describe(segments), damage)
        shutil.rmtree(final, ignore_errors=True)
    pieces.mkdir(parents=True, exist_ok=True)
    tmp = pieces / f"{shard}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    started = time.perf_counter()
    try:
        os.environ.setdefault("RAYON_NUM_THREADS", str(team.threads()))  # before the tokenizer's pool starts
        try:
            counts = build_piece(tmp, segments, check)
        except DataError as error:
            if _is_anothers(error):
                raise
            raise DataError(f"shard {shard} ({describe(segments)}): {error}") from error
        sizes = {name: array_digest(tmp / name) for name in sorted(os.listdir(tmp))}
        done = {"segments": [asdict(s) for s in segments], "checksums": sizes, "counts": counts,
                "bytes": segment_bytes(segments), "tokens": len(np.load(tmp / "tokens.npy", mmap_mode="r")),
                "seconds": round(time.perf_counter() - started, 3), "rank": team.index}
        (tmp / _DONE).write_text(json.dumps(done, indent=1))
        try:
            rename(tmp, final)
        except OSError:  # another rank of a concurrent launch finished the same piece: keep one
            if not (final / _DONE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def path_bytes(path: Path) -> int:
    """A file's size, or the sizes of the files in a directory (a saved dataset)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def segment_bytes(segments: list[Segment]) -> int:
    """The bytes the segments read."""
    total = 0
    for segment in segments:
        if segment.end is not None:
            total += segment.end - segment.start
        else:
            total += sum(path_bytes(Path(name)) for name in segment.paths) - segment.start
    return total


def _piece_damage(piece: Path, segments: list[Segment]) -> str | None:
    """What is wrong with a piece (unfinished, of another plan, a file missing or changed), or None."""
    try:
        done = json.loads((piece / _DONE).read_text())
    except (OSError, ValueError):
        return "unfinished"
    if done.get("segments") != [json.loads(json.dumps(asdict(s))) for s in segments]:
        return "it holds other segments"
    return damaged_file(piece, done)


def _wait_for_pieces(pieces: Path, shards: list[list[Segment]], failed: Path, poll_s: float) -> list[Path]:
    """The piece directories in shard order, once every one is finished (or the team failed)."""
    dirs = [pieces / str(shard) for shard in range(len(shards))]
    started = last_note = time.monotonic()
    while True:
        if failed.is_file():
            raise DataError(f"preprocessing failed on another rank: {failed.read_text()}")
        missing = [shard for shard, piece in enumerate(dirs) if not (piece / _DONE).is_file()]
        if not missing:
            return dirs
        if time.monotonic() - last_note > 60:
            last_note = time.monotonic()
            log.info("data: waiting for %d of %d shard(s) (e.g. shard %d: %s), %.0fs so far", len(missing), len(dirs),
                     missing[0], describe(shards[missing[0]]), last_note - started)
        time.sleep(poll_s)


def _log_shares(dirs: list[Path], shards: list[list[Segment]]) -> None:
    """Each rank's share of the bytes, tokens and time: what the sharding divided."""
    done = [json.loads((piece / _DONE).read_text()) for piece in dirs]
    total = sum(d["bytes"] for d in done) or 1
    for shard, d in enumerate(done):
        log.info("data: shard %d (rank %d): %d bytes (%.1f%% of the corpus, 1/%d = %.1f%%), %d tokens in %.1fs",
                 shard, d["rank"], d["bytes"], 100.0 * d["bytes"] / total, len(dirs), 100.0 / len(dirs),
                 d["tokens"], d["seconds"])


def _is_anothers(error: BaseException) -> bool:
    return isinstance(error, DataError) and str(error).startswith("preprocessing failed on another rank")


def _fail(failed: Path, error: BaseException, team: BuildTeam, shard: int, segments: list[Segment],
          poll_s: float) -> None:
    """Say the failure to the team (the first failure's message stays), then give the others a few polls
    to read it before this rank exits (torchrun stops every rank as soon as one exits)."""
    if _is_anothers(error):
        return
    message = str(error) if isinstance(error, DataError) else f"shard {shard} ({describe(segments)}): {error}"
    try:
        with open(failed, "x") as handle:
            handle.write(f"{type(error).__name__} on rank {team.index} of {team.size}: {message}")
    except OSError:
        return
    if team.size > 1:
        log.error("preprocessing failed: %s", error)
        time.sleep(4 * poll_s)


def merge_pieces(tmp: Path, dirs: list[Path], arrays: tuple[str, ...], start_columns: tuple[int, ...]) -> dict:
    """Concatenate the pieces' token-like `arrays` (TokenWriter .npy files) into `tmp` in shard order,
    and their documents (`docs.npy`, with `start_columns` moved by the tokens before each piece) and
    validation flags (`is_val.npy`); returns {"docs", "is_val", "counts", "tokens"} as one piece built
    in one process would give them (`merge_counts`)."""
    writers = {name: None for name in arrays}
    docs, is_val, counts = [], [], []
    offset = 0
    for piece in dirs:
        for name in arrays:
            source = np.load(piece / name, mmap_mode="r")
            if writers[name] is None:
                writers[name] = TokenWriter(tmp / name, source.dtype)
            for at in range(0, len(source), 1 << 24):
                writers[name].append(np.asarray(source[at : at + (1 << 24)]))
        piece_docs = np.load(piece / "docs.npy")
        piece_docs[:, list(start_columns)] += offset
        docs.append(piece_docs)
        is_val.append(np.load(piece / "is_val.npy"))
        counts.append(json.loads((piece / "counts.json").read_text()))
        offset += len(np.load(piece / arrays[0], mmap_mode="r"))
    for writer in writers.values():
        writer.close()
    return {"docs": np.concatenate(docs), "is_val": np.concatenate(is_val), "counts": merge_counts(counts),
            "tokens": offset}


def save_piece(directory: Path, docs: np.ndarray, is_val: np.ndarray, counts: dict) -> None:
    """A piece's documents, validation flags and counts, beside its token arrays."""
    np.save(directory / "docs.npy", docs)
    np.save(directory / "is_val.npy", is_val)
    (directory / "counts.json").write_text(json.dumps(counts))


def merge_counts(pieces: list[dict]) -> dict:
    """The counts of pieces in order, as one pass over them all counts: numbers add up, the first name
    of a kind stays (`*_example`, maps of first examples), `last_name` is the last one."""
    merged: dict = {}
    for counts in pieces:
        for name, value in counts.items():
            if name == "last_name":
                merged[name] = value if value is not None else merged.get(name)
            elif isinstance(value, dict):
                merged[name] = merge_counts([merged.get(name, {}), value])
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[name] = merged.get(name, 0) + value
            elif merged.get(name) is None:
                merged[name] = value
    return merged
