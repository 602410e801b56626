"""The scheduler API from Python: matching, allocation, commits, tickets, resets, errors."""

import array

import numpy as np
import pytest

import kvshm


def make_service(name: str, **overrides: object) -> kvshm.Service:
    config: dict[str, object] = {
        "block_tokens": 4,
        "device_blocks": 8,
        "host_blocks": 16,
        "region_bytes": 64,
    }
    config.update(overrides)
    return kvshm.Service(name, **config)  # type: ignore[arg-type]


def test_a_prefix_cached_by_one_request_hits_for_the_next(name: str) -> None:
    with make_service(name) as service:
        hasher = kvshm.BlockHasher(4, model="m")
        prompt = np.arange(13, dtype=np.int32)
        hashes = hasher.hash_prompt(prompt)
        assert len(hashes) == 3
        found = service.match_prefix(1, hashes, len(prompt))
        assert (found.blocks, found.cached_tokens) == (0, 0)
        allocation = service.allocate(1, len(prompt))
        assert allocation.new_blocks == 4
        service.wait(allocation.ticket)  # no copy: ready at once
        assert service.commit(1, len(prompt), hashes) == (3, 0)
        service.finish(1)
        found = service.match_prefix(2, hashes, len(prompt))
        assert (found.device_blocks, found.cached_tokens) == (3, 12)
        assert service.lookup(hashes) == (3, 0, 0)
        # With the prompt's length, what a match would hold: a block-aligned prompt of these
        # three blocks recomputes its last one.
        assert service.lookup(hashes, 13) == (3, 0, 0)
        assert service.lookup(hashes, 12) == (2, 0, 0)
        with pytest.raises(kvshm.RequestError, match="3 block hashes"):
            service.lookup(hashes, 8)
        service.check_invariants()


def test_block_tables_are_read_only_uint32_buffers_numpy_wraps_without_a_copy(name: str) -> None:
    with make_service(name) as service:
        service.match_prefix(1, [], 0)
        table = service.allocate(1, 10).block_table
        view = np.asarray(table)
        assert view.dtype == np.uint32
        assert view.tolist() == table.tolist() == [0, 1, 2]
        assert len(table) == 3
        assert table[-1] == 2
        assert not view.flags.writeable
        assert bytes(memoryview(table)) == np.array([0, 1, 2], dtype="<u4").tobytes()
        with pytest.raises(TypeError, match="read-only"):
            memoryview(table).cast("B")[0:1] = b"x"
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 5
        with pytest.raises(IndexError):
            table[3]


@pytest.mark.parametrize(
    "tokens",
    [
        np.arange(9, dtype=np.int32),
        np.arange(9, dtype=np.int64),
        np.arange(9, dtype=np.uint32),
        array.array("I", range(9)),
        list(range(9)),
        range(9),
    ],
)
def test_token_ids_come_from_any_integer_buffer_or_sequence(tokens: object) -> None:
    expected = kvshm.BlockHasher(4).hash_prompt(list(range(9))).tolist()
    assert kvshm.BlockHasher(4).hash_prompt(tokens).tolist() == expected  # type: ignore[arg-type]


def test_hashes_go_in_as_block_hashes_bytes_or_ints(name: str) -> None:
    with make_service(name) as service:
        hashes = kvshm.BlockHasher(4).hash_prompt(range(8))
        service.match_prefix(1, hashes, 9)
        service.allocate(1, 9)
        service.commit(1, 9, hashes.tolist())
        service.finish(1)
        assert service.lookup(hashes) == (2, 0, 0)
        assert service.lookup(bytes(hashes)) == (2, 0, 0)
        assert service.lookup(hashes.to_bytes()[:16]) == (1, 0, 0)
        assert service.lookup([int(h) for h in hashes]) == (2, 0, 0)
        with pytest.raises(ValueError, match="16-byte"):
            service.lookup(b"x" * 17)
        with pytest.raises(ValueError, match="block hash"):
            service.lookup([-1])


def test_bad_token_ids_are_value_errors_not_crashes() -> None:
    hasher = kvshm.BlockHasher(4)
    with pytest.raises(ValueError, match="u32"):
        hasher.hash_prompt([1, 2, -3, 4])
    with pytest.raises(ValueError, match="u32"):
        hasher.hash_prompt(np.array([2**40], dtype=np.int64))
    with pytest.raises(TypeError):
        hasher.hash_prompt("1234")  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(kvshm.ConfigError):
        kvshm.BlockHasher(0)


def test_extending_hashes_with_generated_tokens_matches_hashing_the_whole_sequence() -> None:
    hasher = kvshm.BlockHasher(4, model="m", lora="a", salt=b"tenant")
    tokens = list(range(30))
    prompt = hasher.hash_prompt(tokens[:10])
    assert hasher.extend(prompt, tokens).tolist() == hasher.hash_prompt(tokens).tolist()
    image = [(5, 3, 0xFEED)]
    assert hasher.hash_prompt(tokens, image)[1] != hasher.hash_prompt(tokens)[1]
    other_tenant = kvshm.BlockHasher(4, model="m", lora="a", salt=b"other")
    assert other_tenant.hash_prompt(tokens)[0] != hasher.hash_prompt(tokens)[0]


def test_python_hashes_are_the_rust_crates_frozen_test_vectors() -> None:
    # The same vectors as kvshm::hash's known_vectors test: a key computed in Python names the
    # same block as one computed in Rust, on any machine.
    hasher = kvshm.BlockHasher(4, model="llama-3-8b")
    hashes = [f"{block:032x}" for block in hasher.hash_prompt(list(range(8))).tolist()]
    assert hashes == ["89ad8f2b3272b04c9222c390eb3f2718", "40fa9ec68a7c65a65d9e06f34df05859"]
    image = hasher.hash_prompt(list(range(8)), [(2, 4, 0xFEED)]).tolist()
    assert f"{image[0]:032x}" == "cdda6238054d803a46e677cabf7387a4"


def test_a_multimodal_item_changes_exactly_the_blocks_it_overlaps() -> None:
    hasher = kvshm.BlockHasher(4, model="m")
    tokens = list(range(20))
    plain = hasher.hash_prompt(tokens).tolist()
    # Tokens 6..10 lie in blocks 1 and 2; every later block changes with them (the chain).
    with_item = hasher.hash_prompt(tokens, [(6, 4, 0xC0FFEE)]).tolist()
    assert with_item[0] == plain[0]
    assert all(a != b for a, b in zip(with_item[1:], plain[1:], strict=True))
    # Another content hash for the same placeholder tokens is another key.
    other = hasher.hash_prompt(tokens, [(6, 4, 0xBEEF)]).tolist()
    assert other[0] == plain[0]
    assert other[1] != with_item[1]


def test_every_rust_error_is_a_kvshm_exception_with_its_meaning(name: str) -> None:
    with make_service(name, device_blocks=4, host_blocks=0) as service:
        with pytest.raises(kvshm.UnknownRequestError):
            service.allocate(9, 4)
        service.match_prefix(1, [], 0)
        with pytest.raises(kvshm.DuplicateRequestError):
            service.match_prefix(1, [], 0)
        with pytest.raises(kvshm.OutOfBlocksError):
            service.allocate(1, 100)
        assert service.can_allocate(1, 100).fits is False
        with pytest.raises(ValueError, match="overflow"):
            service.allocate(1, 2**64 - 1, lookahead=1)
        with pytest.raises(kvshm.CommitError):
            service.commit(1, 8, [])
        with pytest.raises(kvshm.TicketError):
            service.wait(12345, timeout=0.1)
        service.allocate(1, 4)
        with pytest.raises(kvshm.ResetRefusedError):
            service.reset()
        assert service.reset(force=True) == [1]
        with pytest.raises(kvshm.ResizeError):
            service.resize_device(5)
        with pytest.raises(ValueError, match="duration"):
            service.wait_for_workers(timeout=-1.0)
        with pytest.raises(kvshm.KvshmTimeoutError):
            service.wait_for_workers(timeout=0.05)
    with pytest.raises(kvshm.SegmentError, match="closed"):
        service.poll()
    for error in (kvshm.OutOfBlocksError, kvshm.TicketError, kvshm.SegmentError):
        assert issubclass(error, kvshm.KvshmError)


def test_bad_configurations_are_config_errors(name: str) -> None:
    with pytest.raises(kvshm.ConfigError, match="name"):
        make_service("bad/name")
    with pytest.raises(kvshm.ConfigError):
        make_service(name, block_tokens=0)
    with pytest.raises(kvshm.ConfigError):
        make_service(name, write_policy="sometimes")
    with pytest.raises(kvshm.ConfigError):
        make_service(name, backend="tpu")
    with pytest.raises(kvshm.ConfigError, match="storage write policy"):
        make_service(name, storage_blocks=8, storage_write_policy="sometimes")
    with pytest.raises(kvshm.ConfigError, match="host"):
        make_service(name, host_blocks=0, storage_blocks=8)
    with pytest.raises(kvshm.ConfigError):
        make_service(name, layers=3, regions=4)
    with pytest.raises(OverflowError):
        make_service(name, device_blocks=-1)
    with pytest.raises(kvshm.ConfigError, match="maximum"):
        make_service(name, storage_blocks=8, storage_backoff=5.0, storage_backoff_max=1.0)
    with pytest.raises(kvshm.ConfigError, match="storage_backoff"):
        make_service(name, storage_blocks=8, storage_backoff=-1.0)


def test_a_storage_tier_starts_up_and_its_state_is_in_the_stats(name: str) -> None:
    with make_service(
        name, storage_blocks=8, storage_backoff=0.1, storage_backoff_max=2.0
    ) as service:
        assert service.storage_tier_down is False
        stats = service.stats()
        assert stats["cache"]["storage_tier_down"] is False
        assert stats["cache"]["storage_outages"] == 0
        assert stats["service"]["storage_tier_probes"] == 0


def test_a_waiting_request_gives_its_holds_back_and_picks_up_blocks_cached_meanwhile(
    name: str,
) -> None:
    with make_service(name) as service:
        hashes = kvshm.BlockHasher(4).hash_prompt(range(16))
        service.match_prefix(1, hashes.prefix(2), 9)
        service.allocate(1, 9)
        service.commit(1, 9, hashes)
        service.finish(1)
        assert service.match_prefix(2, hashes, 17).blocks == 2
        service.match_prefix(3, [], 0)
        service.allocate(3, 17)
        service.commit(3, 17, hashes)
        assert service.rematch(2, hashes, 17).blocks == 4
        service.release_match(2)
        with pytest.raises(kvshm.UnknownRequestError):
            service.release_match(2)
        assert service.common_prefix_blocks(3) == 4
        service.check_invariants()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.match_prefix(-1, [], 0), OverflowError),
        (lambda s: s.match_prefix(1, None, 0), TypeError),
        (lambda s: s.allocate(1, -5), OverflowError),
        (lambda s: s.wait(2**70), OverflowError),
        (lambda s: s.wait(1, timeout=float("nan")), ValueError),
        (lambda s: s.wait(1, timeout=1e300), ValueError),
        (lambda s: s.read_device_region(0, 2**31, 0), ValueError),
        (lambda s: s.read_device_region(7, 0, 0), ValueError),
        (lambda s: s.write_device_region(0, 0, 0, b"short"), ValueError),
        (lambda s: s.write_device_region(0, 0, 99, bytes(64)), ValueError),
        (lambda s: s.commit(1, 2**62, [1, 2]), kvshm.KvshmError),
        (lambda s: s.resize_device(2**32 - 1), kvshm.ResizeError),
        (lambda s: s.lookup([2**128]), ValueError),
    ],
)
def test_bad_arguments_raise_exceptions_never_a_panic(name: str, call, error) -> None:
    # A Rust panic would surface as pyo3's PanicException, a BaseException these do not catch.
    with make_service(name) as service:
        service.match_prefix(1, [], 0)
        with pytest.raises(error):
            call(service)
        service.check_invariants()


def test_offload_calls_with_bad_arguments_raise_exceptions_never_a_panic() -> None:
    manager = kvshm.OffloadManager(4)
    with pytest.raises(TypeError):
        manager.prepare_store([b"a", 5], "r")  # type: ignore[list-item]  # on purpose
    with pytest.raises(TypeError):
        manager.complete_store(None)  # type: ignore[arg-type]  # on purpose
    manager.prepare_store([b"a"], "r")
    with pytest.raises(ValueError, match="positions"):
        manager.on_request_finished("r", [1, 2, 3])
    with pytest.raises(kvshm.ConfigError):
        kvshm.OffloadManager(4, eviction="random")  # type: ignore[arg-type]  # on purpose
    with pytest.raises(kvshm.ConfigError):
        kvshm.OffloadManager(4, tag_bytes=9)
    with pytest.raises(kvshm.ConfigError):
        kvshm.OffloadManager(2**32 - 1)
    manager.check_invariants()
