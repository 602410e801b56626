//! What the scheduler calls of `Service` return: `PrefixMatch`, `Allocation`, `ShortenedHit` and
//! `AllocationCheck`, frozen Python objects converted from the Rust results.

use pyo3::prelude::*;

use crate::buffers::U32Array;

/// What `match_prefix` found and now holds.
#[pyclass(frozen, get_all, skip_from_py_object, module = "kvshm")]
#[derive(Clone, Copy)]
pub struct PrefixMatch {
    pub device_blocks: usize,
    pub host_blocks: usize,
    /// Hits on the storage tier (a service with one): loaded through host by `allocate`.
    pub storage_blocks: usize,
    pub cached_tokens: usize,
}

#[pymethods]
impl PrefixMatch {
    #[getter]
    fn blocks(&self) -> usize {
        self.device_blocks + self.host_blocks + self.storage_blocks
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixMatch(device_blocks={}, host_blocks={}, storage_blocks={}, cached_tokens={})",
            self.device_blocks, self.host_blocks, self.storage_blocks, self.cached_tokens
        )
    }
}

impl From<kvshm::manager::PrefixMatch> for PrefixMatch {
    fn from(found: kvshm::manager::PrefixMatch) -> PrefixMatch {
        PrefixMatch {
            device_blocks: found.device_blocks,
            host_blocks: found.host_blocks,
            storage_blocks: found.storage_blocks,
            cached_tokens: found.cached_tokens,
        }
    }
}

/// A successful allocation: the request's block table, the blocks this call added at its end,
/// and the ticket to wait on before touching them.
#[pyclass(frozen, get_all, module = "kvshm")]
pub struct Allocation {
    pub ticket: u64,
    pub block_table: Py<U32Array>,
    pub new_blocks: usize,
}

#[pymethods]
impl Allocation {
    fn __repr__(&self) -> String {
        format!(
            "Allocation(ticket={}, block_table={:?}, new_blocks={})",
            self.ticket,
            self.block_table.get().values(),
            self.new_blocks
        )
    }
}

/// What `wait` returns when the storage tier missed some hits: the leading block-table positions
/// still cached, and the request's block table as it is now. From `cached_blocks` on it may
/// differ from the one `allocate` returned (a request that shared a LOAD with another one gets
/// blocks of its own there): the engine computes those positions into this table. Always truthy,
/// even with `cached_blocks == 0`.
#[pyclass(frozen, get_all, module = "kvshm")]
pub struct ShortenedHit {
    pub cached_blocks: u32,
    pub block_table: Py<U32Array>,
}

#[pymethods]
impl ShortenedHit {
    fn __repr__(&self) -> String {
        format!(
            "ShortenedHit(cached_blocks={}, block_table={:?})",
            self.cached_blocks,
            self.block_table.get().values()
        )
    }
}

/// What `allocate` would need and could get now.
#[pyclass(frozen, get_all, module = "kvshm")]
pub struct AllocationCheck {
    pub needed: usize,
    pub available: usize,
}

#[pymethods]
impl AllocationCheck {
    #[getter]
    fn fits(&self) -> bool {
        self.available >= self.needed
    }

    fn __repr__(&self) -> String {
        format!("AllocationCheck(needed={}, available={})", self.needed, self.available)
    }
}
