"""What kvshm hands an engine that crosses a process boundary pickles: vLLM sends the chunk lists
of its load and store specs from the scheduler to its worker processes with pickle."""

import pickle

import numpy as np
import pytest

import kvshm


def test_a_u32_array_pickles_to_an_equal_array_with_its_buffer() -> None:
    array = kvshm.U32Array([7, 0, 2**32 - 1])
    copy = pickle.loads(pickle.dumps(array))
    assert isinstance(copy, kvshm.U32Array)
    assert copy == array
    assert copy.tolist() == [7, 0, 2**32 - 1]
    assert np.asarray(copy).dtype == np.uint32


def test_the_chunks_a_manager_hands_out_pickle() -> None:
    manager = kvshm.OffloadManager(8, tag_bytes=4)
    keys = [bytes([n]) * 32 + bytes(4) for n in range(3)]
    prepared = manager.prepare_store(keys, "r")
    assert prepared is not None
    _, chunks, _ = prepared
    assert pickle.loads(pickle.dumps(chunks)).tolist() == chunks.tolist()


def test_a_u32_array_of_values_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="not a u32"):
        kvshm.U32Array([-1])
    with pytest.raises(TypeError):
        kvshm.U32Array("01")  # type: ignore[arg-type]  # the wrong type on purpose


def test_arrays_and_hashes_iterate_as_their_lists() -> None:
    array = kvshm.U32Array([3, 1, 2**32 - 1])
    assert list(array) == array.tolist() == [3, 1, 2**32 - 1]
    hashes = kvshm.BlockHasher(4).hash_prompt(range(12))
    assert [value for value in hashes] == hashes.tolist()
    assert len(list(hashes)) == 3
    assert "__iter__" in dir(array), "iterable by its own method, not only by indexing"
