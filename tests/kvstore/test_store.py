"""The prefix store on a local directory: a unit is found only for its exact prefix (tokens, images, salt,
model), the longest one inside a prompt wins, and every way a file can go wrong (truncated, corrupted, foreign,
expired, half written) is a miss and never bytes of another sequence."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from deepinfer_plugins.kvstore import ANCHOR_TOKENS, Array, PrefixKey, PrefixStore, Retention, UnitError
from deepinfer_plugins.kvstore.unit import decode, encode, read_header

MODEL = "tiny-0123456789abcdef"
TOKENS = list(range(1000, 1000 + 3 * ANCHOR_TOKENS + 57))


def arrays_for(num_tokens: int, block: int = 16, width: int = 8) -> tuple[list[Array], list[bytes]]:
    """Two caches: one keeps every block, one (a window) only the last two; bytes derived from the blocks."""
    blocks = -(-num_tokens // block)
    full = Array("layers.0.compressed_cache", width, tuple(range(blocks)))
    window = Array("layers.0.window_cache", width, tuple(range(max(0, blocks - 2), blocks)))
    payload = [bytes((num_tokens + i) % 251 for i in range(a.nbytes)) for a in (full, window)]
    return [full, window], payload


def save(store: PrefixStore, key: PrefixKey, num_tokens: int, retention_s: float = 3600.0) -> None:
    arrays, payloads = arrays_for(num_tokens)
    store.write(key.digest(num_tokens), key.anchor(num_tokens), num_tokens, retention_s, arrays, payloads)


@pytest.fixture
def store(tmp_path):
    return PrefixStore(tmp_path, MODEL)


def test_a_unit_round_trips_and_its_arrays_are_the_bytes_written(store):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300)
    found = store.find(PrefixKey(MODEL, TOKENS + [7, 8]), longest=len(TOKENS))
    assert (found.num_tokens, found.prefix) == (300, key.digest(300))
    header, arrays = store.read(found.prefix)
    expected_arrays, expected_payloads = arrays_for(300)
    assert header.arrays == tuple(expected_arrays) and header.num_tokens == 300
    assert [bytes(arrays[a.name]) for a in expected_arrays] == expected_payloads


def test_the_longest_stored_prefix_inside_the_bounds_wins(store):
    key = PrefixKey(MODEL, TOKENS)
    for n in (5, 255, 256, 300, 700):
        save(store, key, n)
    assert store.find(key, longest=len(TOKENS)).num_tokens == 700
    assert store.find(key, longest=699).num_tokens == 300
    assert store.find(key, longest=299).num_tokens == 256
    assert store.find(key, longest=255).num_tokens == 255
    assert store.find(key, longest=699, shortest=300) is None  # nothing longer than what is computed already
    assert store.find(key, longest=4) is None


@pytest.mark.parametrize("other", [
    pytest.param(lambda: PrefixKey(MODEL, TOKENS[:299] + [1]), id="last token differs"),
    pytest.param(lambda: PrefixKey(MODEL, [1] + TOKENS[1:]), id="first token differs"),
    pytest.param(lambda: PrefixKey(MODEL, TOKENS, images=[(10, "img-b")]), id="other image"),
    pytest.param(lambda: PrefixKey(MODEL, TOKENS, images=[(11, "img-a")]), id="image elsewhere"),
    pytest.param(lambda: PrefixKey(MODEL, TOKENS, images=[(10, "img-a")], salt="tenant-2"), id="other salt"),
    pytest.param(lambda: PrefixKey("other-model", TOKENS, images=[(10, "img-a")]), id="other model"),
])
def test_a_unit_serves_only_its_own_prefix(store, other):
    save(store, PrefixKey(MODEL, TOKENS, images=[(10, "img-a")]), 300)
    assert store.find(PrefixKey(MODEL, TOKENS, images=[(10, "img-a")]), longest=400).num_tokens == 300
    assert store.find(other(), longest=400) is None


def test_an_image_after_the_boundary_does_not_change_the_prefix():
    assert (PrefixKey(MODEL, TOKENS, images=[(400, "x")]).digest(300)
            == PrefixKey(MODEL, TOKENS, images=[(400, "y")]).digest(300))
    assert (PrefixKey(MODEL, TOKENS, images=[(299, "x")]).digest(300)
            != PrefixKey(MODEL, TOKENS, images=[(299, "y")]).digest(300))


def corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def foreign(path):
    """Another model's intact unit put in its place (a shared directory misused, a copied file)."""
    header, _ = read_header(path.read_bytes())
    arrays, payloads = arrays_for(header.num_tokens)
    path.write_bytes(encode(type(header)("other-model", header.prefix, header.anchor, header.num_tokens,
                                         header.retention_s, tuple(arrays)), payloads))


def garbage(path):
    path.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage", [corrupt, truncate, foreign, garbage])
def test_a_damaged_unit_is_a_miss_and_the_next_shorter_unit_serves(store, damage):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300)
    save(store, key, 500)
    damage(store.unit_path(key.digest(500)))
    assert store.find(key, longest=len(TOKENS)).num_tokens == 300
    assert store.counters.take()["invalid"] == 1
    with pytest.raises(UnitError):
        store.read(key.digest(500))


def test_decode_refuses_a_unit_of_another_prefix(store):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300)
    data = store.unit_path(key.digest(300)).read_bytes()
    decode(data, MODEL, key.digest(300))
    with pytest.raises(UnitError, match="another prefix"):
        decode(data, MODEL, key.digest(301))


def test_an_expired_unit_is_never_served_and_the_sweep_removes_it(store):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300, retention_s=1.0)
    save(store, key, 200, retention_s=3600.0)
    assert store.find(key, longest=400).num_tokens == 300
    old = time.time() - 5
    os.utime(store.unit_path(key.digest(300)), (old, old))
    assert store.find(key, longest=400).num_tokens == 200
    result = store.sweep()
    assert (result.expired, result.evicted) == (1, 0) and store.counters.take()["expiries"] == 1
    assert not store.unit_path(key.digest(300)).exists() and store.unit_path(key.digest(200)).exists()
    assert [m.name for m in (store.dir / "anchors").glob("*/*")] == [f"200-{key.digest(200)}"]


def test_serving_a_unit_restarts_its_retention(store):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300, retention_s=10.0)
    old = time.time() - 8
    os.utime(store.unit_path(key.digest(300)), (old, old))
    store.touch(key.digest(300))
    assert store.sweep(now=time.time() + 5).expired == 0
    assert store.sweep(now=time.time() + 11).expired == 1


def test_over_capacity_the_least_recently_used_units_go_first(store):
    key = PrefixKey(MODEL, TOKENS)
    for age, n in enumerate((100, 200, 300, 400)):
        save(store, key, n)
        then = time.time() - 100 + age * 10
        os.utime(store.unit_path(key.digest(n)), (then, then))
    store.touch(key.digest(100))  # used just now: the most recent
    sizes = {n: store.unit_path(key.digest(n)).stat().st_size for n in (100, 200, 300, 400)}
    result = store.sweep(capacity_bytes=sizes[100] + sizes[400])
    assert result.evicted == 2 and result.kept_bytes == sizes[100] + sizes[400]
    assert [n for n in (100, 200, 300, 400) if store.unit_path(key.digest(n)).exists()] == [100, 400]


def test_a_writer_that_died_mid_write_leaves_nothing_servable(store):
    key = PrefixKey(MODEL, TOKENS)
    save(store, key, 300)
    path = store.unit_path(key.digest(300))
    partial = path.parent / f".{key.digest(300)}.999.dead.tmp"
    partial.write_bytes(path.read_bytes()[:50])
    path.unlink()
    assert store.find(key, longest=400) is None
    assert store.sweep().expired == 0 and partial.exists()  # may still be a live writer's
    old = time.time() - 7200
    os.utime(partial, (old, old))
    store.sweep()
    assert not partial.exists()
    assert not list((store.dir / "anchors").glob("*/*"))


def write_repeatedly(root, seed):
    store = PrefixStore(root, MODEL)
    key = PrefixKey(MODEL, TOKENS)
    for _ in range(20):
        save(store, key, 600)


def test_writers_of_one_prefix_at_once_leave_one_intact_unit(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=write_repeatedly, args=(tmp_path, i)) for i in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    store = PrefixStore(tmp_path, MODEL)
    key = PrefixKey(MODEL, TOKENS)
    files = list((store.dir / "units").rglob("*"))
    assert [p for p in files if p.is_file()] == [store.unit_path(key.digest(600))]
    header, arrays = store.read(key.digest(600))
    assert [bytes(arrays[a.name]) for a in header.arrays] == arrays_for(600)[1]


def test_retention_classes():
    retention = Retention(agent_s=3.0, chat_s=7.0)
    assert (retention.seconds(agent=True), retention.seconds(agent=False)) == (3.0, 7.0)
    assert Retention(fixed_s=5.0).seconds(agent=True) == 5.0
    assert Retention(fixed_s=5.0).seconds(agent=False, requested_s=0.0) == 0.0
    assert (Retention().agent_s, Retention().chat_s) == (3 * 86400, 7 * 86400)


def test_a_model_tag_must_be_a_file_name(tmp_path):
    for tag in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            PrefixStore(tmp_path, tag)


def test_a_unit_checked_once_is_not_read_again_until_its_file_changes(store, monkeypatch):
    from deepinfer_plugins.kvstore import store as store_module

    monkeypatch.setattr(store_module, "VERIFIED_ENTRIES", 2)
    key = PrefixKey(MODEL, TOKENS)
    for n in (100, 200, 300):
        save(store, key, n)
    store.counters.take()
    for longest in (300, 300, 200, 100):
        store.find(key, longest=longest)
    size = store.unit_path(key.digest(300)).stat().st_size
    assert store.counters.take()["bytes_read"] == size + store.unit_path(key.digest(200)).stat().st_size + \
        store.unit_path(key.digest(100)).stat().st_size, "the second lookup of 300 read nothing"
    assert len(store._verified) == 2
    flip = store.unit_path(key.digest(100))
    data = bytearray(flip.read_bytes())
    data[-1] ^= 1
    flip.write_bytes(bytes(data))
    assert store.find(key, longest=100) is None, "a changed file is checked again"
