import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from llmq.artifacts import ArtifactError, ArtifactNotFound, Store


def _write(store, name="thing", payload=b"hello", **kw):
    with store.create("model", name, **kw) as w:
        (w.dir / "a.bin").write_bytes(payload)
        (w.dir / "sub").mkdir()
        (w.dir / "sub" / "b.txt").write_text("nested")
        w.metrics["score"] = 1.5
    return w.artifact


def test_roundtrip_versions_and_refs(store):
    a1 = _write(store, config={"k": 1})
    a2 = _write(store, payload=b"other")
    assert (a1.version, a2.version) == (1, 2)
    assert a1.path == store.root / "thing" / "v1"
    m = json.loads((a1.path / "llmq.json").read_text())
    assert m["kind"] == "model"
    assert m["config"] == {"k": 1}
    assert m["metrics"] == {"score": 1.5}
    assert set(m["files"]) == {"a.bin", "sub/b.txt"}
    assert m["environment"]["python"]
    assert store.resolve("thing").version == 2
    assert store.resolve("thing/v1").id == a1.id
    assert store.resolve("thing@v1").id == a1.id
    assert store.resolve(str(a2.path)).id == a2.id
    assert store.resolve(a1.id[:10]).version == 1
    with pytest.raises(ArtifactNotFound, match="no version v9"):
        store.resolve("thing/v9")
    with pytest.raises(ArtifactNotFound, match="no artifact 'nothing'"):
        store.resolve("nothing")


def test_content_id_depends_on_payload_only(tmp_path):
    a = _write(Store(tmp_path / "s1"), name="x")
    b = _write(Store(tmp_path / "s2"), name="y", config={"different": True})
    c = _write(Store(tmp_path / "s3"), name="x", payload=b"hellO")
    assert a.id == b.id != c.id


def test_failed_write_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.create("model", "broken") as w:
            (w.dir / "half.bin").write_bytes(b"x" * 100)
            raise RuntimeError("crash mid-write")
    assert store.versions("broken") == []
    assert not (store.root / "broken").exists()  # not even an empty name directory (issue 36, item 6)


def test_empty_artifact_refused(store):
    with pytest.raises(ArtifactError, match="no payload"):
        with store.create("model", "empty"):
            pass
    assert store.versions("empty") == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra", "manifest"])
def test_damage_is_detected_naming_the_file(store, damage):
    art = _write(store)
    target = art.path / "a.bin"
    os.chmod(target, 0o644)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[2] ^= 0x01
        target.write_bytes(bytes(data))
        msg = "a.bin does not match its sha256"
    elif damage == "truncate":
        target.write_bytes(b"hell")
        msg = "a.bin has size 4"
    elif damage == "delete":
        target.unlink()
        msg = "a.bin is missing"
    elif damage == "extra":
        (art.path / "sub" / "intruder.txt").write_text("?")
        msg = "unexpected file sub/intruder.txt"
    else:
        (art.path / "llmq.json").write_text("{not json")
        msg = "not valid JSON"
    with pytest.raises(ArtifactError, match=msg):
        store.resolve("thing")


def _edit_manifest(art, edit):
    """Change llmq.json by hand, as an attacker or a careless editor would, leaving the digest as written."""
    f = art.path / "llmq.json"
    m = json.loads(f.read_text())
    edit(m)
    os.chmod(f, 0o644)
    f.write_text(json.dumps(m, indent=2))


FORGERIES = {
    "metrics": lambda m: m["metrics"].update(score=99.0),
    "parents": lambda m: m["parents"].append("f" * 64),
    "config": lambda m: m["config"].update(k=2),
    "kind": lambda m: m.update(kind="engine"),
    "command": lambda m: m.update(command="llmq quantize --bits 8 honest"),
    "files": lambda m: m["files"]["a.bin"].update(sha256="0" * 64),
    "digest removed": lambda m: m.pop("digest"),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_manifest_edit_is_an_error_naming_llmq_json(store, forgery):
    art = _write(store, config={"k": 1})
    _edit_manifest(art, FORGERIES[forgery])
    for load in (lambda: store.resolve("thing"), lambda: store.resolve("thing", verify=False),
                 lambda: store.by_id(art.id, verify=False)):
        with pytest.raises(ArtifactError, match=r"v1/llmq\.json: manifest was edited after it was written"):
            load()
    damaged = []
    assert store.list(damaged=damaged) == []
    assert [ref for ref, _ in damaged] == ["thing/v1"]


def test_timings_are_left_out_of_the_digest_and_named(store):
    from llmq.artifacts.manifest import RUN_MEASUREMENTS

    assert {"wall_time_s", "wall_s", "peak_rss_bytes"} <= RUN_MEASUREMENTS
    with store.create("model", "timed") as w:
        (w.dir / "a.bin").write_bytes(b"x")
        w.metrics.update(wall_time_s=1.25, peak_rss_bytes=10, score=1.0)
    _edit_manifest(w.artifact, lambda m: (m["metrics"].update(wall_time_s=9.0), m.update(created="2000-01-01")))
    assert store.resolve("timed").metrics["wall_time_s"] == 9.0
    _edit_manifest(w.artifact, lambda m: m["metrics"].update(score=2.0))
    with pytest.raises(ArtifactError, match="llmq.json: manifest was edited"):
        store.resolve("timed")


def test_lineage_through_a_forged_parent_is_an_error(store):
    src = _write(store, name="src")
    top = _write(store, name="top", payload=b"t", parents=[src.id])
    _edit_manifest(src, lambda m: m["config"].update(source="elsewhere"))
    with pytest.raises(ArtifactError, match=r"src/v1/llmq\.json: manifest was edited"):
        store.lineage(top)


def test_an_unsealed_schema_1_manifest_still_loads(store):
    """Stores written before the digest keep working: their ids, parent references and recipe keys are unchanged."""
    art = _write(store)
    _edit_manifest(art, lambda m: (m.pop("digest"), m.update(schema=1)))
    assert store.resolve("thing").id == art.id


@pytest.mark.parametrize("field,value", [("files", ["a.bin"]), ("parents", "abc"), ("metrics", [1]),
                                         ("version", "1"), ("id", 5)])
def test_a_malformed_manifest_is_damaged_and_the_rest_still_lists(store, field, value):
    bad = _write(store, name="bad")
    good = _write(store, name="good", payload=b"g")
    _edit_manifest(bad, lambda m: m.update({field: value}))
    damaged = []
    assert [a.ref for a in store.list(damaged=damaged)] == ["good/v1"]
    assert [ref for ref, _ in damaged] == ["bad/v1"]
    assert "bad/v1/llmq.json: manifest is malformed" in str(damaged[0][1])
    with pytest.raises(ArtifactError, match="llmq.json: manifest is malformed"):
        store.resolve("bad")
    assert store.resolve(good.id).ref == "good/v1"


def test_bad_names_and_kinds(store):
    with pytest.raises(ArtifactError, match="invalid artifact name"):
        store.create("model", "../escape")
    with pytest.raises(ArtifactError, match="unknown artifact kind"):
        store.create("weights", "ok")


def test_payload_is_read_only(store):
    art = _write(store)
    assert (art.path / "a.bin").stat().st_mode & 0o222 == 0


def _concurrent_writer(root: str, i: int, q) -> None:
    store = Store(root)
    arts = []
    for j in range(5):
        with store.create("model", "shared") as w:
            (w.dir / "data.bin").write_bytes(f"writer {i} item {j}".encode() * 1000)
        arts.append((w.artifact.version, w.artifact.id))
    q.put(arts)


def test_concurrent_writers_get_distinct_versions(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_concurrent_writer, args=(str(tmp_path), i, q)) for i in range(4)]
    for p in procs:
        p.start()
    results = [item for _ in procs for item in q.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    versions = [v for v, _ in results]
    assert sorted(versions) == list(range(1, 21))
    store = Store(tmp_path)
    for v, cid in results:
        art = store.resolve(f"shared/v{v}")  # verifies every file
        assert art.id == cid
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".staging")]


def _killed_writer(root: str, ready) -> None:
    with Store(root).create("model", "crashy") as w:
        (w.dir / "half.bin").write_bytes(b"x" * 1000)
        ready.set()
        time.sleep(60)  # killed here, mid-write


def test_a_killed_writers_staging_is_removed_by_the_next_writer_only(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_killed_writer, args=(str(tmp_path), ready))
    proc.start()
    assert ready.wait(60)
    name_dir = tmp_path / "crashy"
    live = [p.name for p in name_dir.iterdir() if p.name.startswith(".staging")]
    assert len(live) == 1
    with Store(tmp_path).create("model", "crashy") as w:  # a live writer's staging is left alone
        (w.dir / "a.bin").write_bytes(b"1")
        assert live[0] in {p.name for p in name_dir.iterdir()}
    proc.kill()
    proc.join()
    other_host = name_dir / f".staging-elsewhere-{proc.pid}-{'0' * 32}"
    other_host.mkdir()  # another machine's writer on a shared filesystem: not ours to judge
    art = _write(Store(tmp_path), name="crashy")
    left = {p.name for p in name_dir.iterdir()}
    assert live[0] not in left
    assert other_host.name in left
    assert art.version == 2


def test_a_killed_writers_staging_is_removed_at_the_next_store_open(tmp_path):
    """Issue 54 item 8: a killed writer's staging stayed until the next write of that name. Opening the store removes
    it (this host's, its process gone); a live writer's and another host's stay."""
    import subprocess

    from llmq.artifacts.store import _host

    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / "crashy" / f".staging-{_host()}-{dead.pid}-{'a' * 32}"
    live = tmp_path / "other" / f".staging-{_host()}-{os.getpid()}-{'b' * 32}"
    elsewhere = tmp_path / "crashy" / f".staging-elsewhere-{dead.pid}-{'c' * 32}"
    for d in (left, live, elsewhere):
        d.mkdir(parents=True)
        (d / "half.bin").write_bytes(b"x")
    Store.open(tmp_path)
    assert not left.exists()
    assert live.exists()
    assert elsewhere.exists()


def test_lineage_follows_parents(store):
    src = _write(store, name="src")
    mid = _write(store, name="mid", payload=b"m", parents=[src.id])
    top = _write(store, name="top", payload=b"t", parents=[mid.id])
    assert [a.name for a in store.lineage(top)] == ["top", "mid", "src"]
    assert Path(store.lineage(top)[-1].path).name == "v1"


# Loads check sizes and stamps; only `verify(full=True)` (`llmq verify`) re-hashes everything.

def _write_settled(store, name="thing", mtime_offset=-60):
    """`_write`, with the payload's mtimes moved `mtime_offset` seconds (past: stampable at write; future: racy)."""
    with store.create("model", name) as w:
        (w.dir / "a.bin").write_bytes(b"hello")
        (w.dir / "sub").mkdir()
        (w.dir / "sub" / "b.txt").write_text("nested")
        t = time.time_ns() + mtime_offset * 10**9
        for p in (w.dir / "a.bin", w.dir / "sub" / "b.txt"):
            os.utime(p, ns=(t, t))
    return w.artifact


@pytest.fixture
def hashes(monkeypatch):
    """Every file the artifacts package hashes, in order."""
    import llmq.artifacts.hashing as hashing

    seen, real = [], hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p: seen.append(Path(p).name) or real(p))
    return seen


def _flip_in_place(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_write_hashes_once_and_loads_hash_nothing(store, hashes):
    art = _write_settled(store)
    assert sorted(hashes) == ["a.bin", "b.txt"]
    hashes.clear()
    for _ in range(2):
        assert store.resolve("thing").id == art.id
        assert store.resolve(art.id[:10]).id == art.id
        assert store.resolve(str(art.path)).id == art.id
    assert hashes == []
    # the stamp lives beside the versions: the artifact directory and its id are what the writer committed
    assert sorted(p.relative_to(art.path).as_posix() for p in art.path.rglob("*")) == ["a.bin", "llmq.json", "sub",
                                                                                       "sub/b.txt"]
    assert (store.root / ".stamps" / "thing" / "v1.json").is_file()
    assert store.names() == ["thing"]
    assert art.verify(full=True) == 2
    assert sorted(hashes) == ["a.bin", "b.txt"]


def test_flip_keeping_size_and_mtime_passes_a_load_but_not_verify(store, hashes):
    """The documented trade-off: bit rot that leaves size and mtime alone is only caught by a full verify."""
    art = _write_settled(store)
    _flip_in_place(art.path / "a.bin", keep_mtime=True)
    hashes.clear()
    assert store.resolve("thing").id == art.id
    assert hashes == []
    with pytest.raises(ArtifactError, match="file a.bin does not match its sha256"):
        store.resolve("thing", verify=False).verify(full=True)
    with pytest.raises(ArtifactError, match="file a.bin does not match its sha256"):
        store.resolve("thing")  # the failed verify dropped the stamp: loads re-hash and refuse from now on


def test_flip_that_moves_the_mtime_is_caught_on_load(store, hashes):
    art = _write_settled(store)
    _flip_in_place(art.path / "a.bin", keep_mtime=False)
    hashes.clear()
    with pytest.raises(ArtifactError, match="file a.bin does not match its sha256"):
        store.resolve("thing")
    assert hashes == ["a.bin"]  # b.txt still trusted from its stamp


def test_racy_file_is_never_trusted_from_the_stamp(store, hashes):
    """A file whose mtime is not older than its stamp could be rewritten within the same clock tick unnoticed."""
    art = _write_settled(store, mtime_offset=3600)
    _flip_in_place(art.path / "a.bin", keep_mtime=True)
    with pytest.raises(ArtifactError, match="file a.bin does not match its sha256"):
        store.resolve("thing")


@pytest.mark.parametrize("damage", ["truncate", "delete", "extra"])
def test_size_missing_and_extra_are_caught_on_load_without_hashing(store, hashes, damage):
    art = _write_settled(store)
    target = art.path / "a.bin"
    os.chmod(target, 0o644)
    if damage == "truncate":
        target.write_bytes(b"hell")
        msg = "file a.bin has size 4, manifest says 5"
    elif damage == "delete":
        target.unlink()
        msg = "file a.bin is missing"
    else:
        (art.path / "extra.bin").write_bytes(b"?")
        msg = "unexpected file extra.bin"
    hashes.clear()
    with pytest.raises(ArtifactError, match=msg):
        store.resolve("thing")
    assert hashes == []


def test_copied_store_rehashes_once_then_loads_from_the_stamp(tmp_path, store, hashes):
    import shutil

    art = _write_settled(store)
    copy = Store(tmp_path / "elsewhere")
    shutil.copytree(store.root, copy.root)  # stamps and mtimes travel, inodes do not (as on another machine)
    hashes.clear()
    assert copy.resolve("thing").id == art.id
    assert sorted(hashes) == ["a.bin", "b.txt"]
    hashes.clear()
    assert copy.resolve("thing").id == art.id
    assert hashes == []
    assert store.resolve("thing").id == art.id
    assert hashes == []  # the original's stamp is untouched


def test_artifact_outside_a_store_layout_is_rehashed_on_every_load(tmp_path, store, hashes):
    import shutil

    art = _write_settled(store)
    loose = tmp_path / "loose-copy"
    shutil.copytree(art.path, loose)
    hashes.clear()
    for _ in range(2):
        assert store.resolve(str(loose)).id == art.id
    assert len(hashes) == 4
    assert sorted(p.name for p in loose.iterdir()) == ["a.bin", "llmq.json", "sub"]


def test_a_stage_that_cannot_fit_is_refused_before_writing(store, monkeypatch):
    """Issue 36, item 6: the free space is checked against the payload's estimate at the start of a stage (a full
    disk used to surface minutes later, from the safetensors writer)."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 5 << 20))
    with pytest.raises(ArtifactError, match=r"^big needs about 100 MiB but the device of .* has 5 MiB free"):
        with store.create("model", "big", needs=100 << 20) as w:
            (w.dir / "x.bin").write_bytes(b"x")
    assert not (store.root / "big").exists()
    with store.create("model", "small", needs=1 << 20) as w:  # what fits goes ahead
        (w.dir / "x.bin").write_bytes(b"x")
    assert store.versions("small") == [1]
