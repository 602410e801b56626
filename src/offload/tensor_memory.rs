//! In-process copies between an engine's KV tensors (CPU tensors, in this process's memory) and
//! the shared-memory host tier, over the block pairs [`super::transfer`] planned.
//!
//! Core types: [`TensorMemory`] (each tensor's block 0 and block stride), [`CopyError`].
//!
//! One copy ([`TensorMemory::copy`]): check that the host tier holds the layout's host blocks
//! and that the group exists; then, for each pair and each tensor of the group, copy one page
//! between the tensor's block and its place in the host block (tensor `t`'s page at
//! `t * page_bytes`).

use kvshm_ipc::arena::Arena;

use super::transfer::{Direction, EngineLayout, GroupCopy, PlanError};

/// Why an in-process copy could not run; nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("tensor {tensor} holds {rows} blocks of {row_bytes} bytes; the layout needs {needed} blocks of {page_bytes}")]
    TensorTooSmall { tensor: usize, rows: u64, row_bytes: u64, needed: u32, page_bytes: u64 },
    #[error("{given} tensors given, the layout has {expected}")]
    TensorCount { given: usize, expected: u32 },
    #[error("the host tier holds {len} bytes, the layout needs {needed}")]
    HostTierTooSmall { len: usize, needed: u64 },
    #[error("group {group} is not one of the layout's {groups}")]
    UnknownGroup { group: usize, groups: usize },
    #[error("layout: {0}")]
    Layout(#[from] PlanError),
}

/// The engine's KV tensors of one rank, in this process's memory (CPU tensors).
#[derive(Debug)]
pub struct TensorMemory {
    /// Address of block 0 of each tensor and the bytes from one block to the next.
    tensors: Vec<(usize, u64)>,
}

impl TensorMemory {
    /// Describes `tensors` as `(address of block 0, blocks, bytes between blocks)`.
    ///
    /// # Safety
    /// Each tensor's memory (`blocks * stride` bytes from its address) stays valid, readable and
    /// writable while this value lives, and nothing else writes the blocks of a transfer while
    /// it runs (the engine fences a transfer's blocks until it completes: vLLM does).
    pub unsafe fn new(
        layout: &EngineLayout,
        tensors: &[(usize, u64, u64)],
    ) -> Result<TensorMemory, CopyError> {
        if tensors.len() != layout.tensors as usize {
            return Err(CopyError::TensorCount { given: tensors.len(), expected: layout.tensors });
        }
        for (tensor, &(_, rows, row_bytes)) in tensors.iter().enumerate() {
            if rows < u64::from(layout.device_blocks) || row_bytes < layout.page_bytes {
                return Err(CopyError::TensorTooSmall {
                    tensor,
                    rows,
                    row_bytes,
                    needed: layout.device_blocks,
                    page_bytes: layout.page_bytes,
                });
            }
        }
        Ok(TensorMemory {
            tensors: tensors.iter().map(|&(address, _, stride)| (address, stride)).collect(),
        })
    }

    /// Copies `copy`'s pairs between the tensors of its group and the host tier; returns the
    /// bytes moved. The pairs come from `layout.plan` (ids in range); the host tier must hold
    /// the layout's host blocks.
    pub fn copy(
        &self,
        layout: &EngineLayout,
        host: &Arena,
        direction: Direction,
        copy: &GroupCopy,
    ) -> Result<u64, CopyError> {
        let host_blocks = u64::from(layout.host_blocks()?);
        let needed = layout.host_tier_bytes()?;
        if (host.data_len() as u64) < needed {
            return Err(CopyError::HostTierTooSmall { len: host.data_len(), needed });
        }
        let tensors = layout
            .groups
            .get(copy.group)
            .ok_or(CopyError::UnknownGroup { group: copy.group, groups: layout.groups.len() })?;
        let page = layout.page_bytes as usize;
        let mut bytes = 0u64;
        for pair in &copy.pairs {
            let (device, host_block) = match direction {
                Direction::Store => (pair.src, pair.dst),
                Direction::Load => (pair.dst, pair.src),
            };
            assert!(
                device < layout.device_blocks && u64::from(host_block) < host_blocks,
                "pairs from EngineLayout::plan are in range: a programming error otherwise"
            );
            for &tensor in tensors {
                let (base, stride) = self.tensors[tensor as usize];
                let device_at = base + device as usize * stride as usize;
                let host_offset = host_block as u64 * layout.host_block_bytes()
                    + u64::from(tensor) * layout.page_bytes;
                // SAFETY: 1. the device page lies inside the tensor: `device < device_blocks <=
                // rows` and `page <= stride` (checked in `new`), and the tensor memory is valid
                // (the premise of `new`); 2. the host page lies inside the arena: `host_block <
                // host_blocks` and the arena holds `host_blocks * host_block_bytes` bytes
                // (checked above); 3. the two never overlap (engine memory vs the arena's
                // mapping); 4. no data race: the engine fences a transfer's device blocks, and
                // the manager never hands a chunk being read or written to another transfer
                // (trusted peers: this process alone copies into its rank's host tier).
                unsafe {
                    let host_at = host.data_ptr().add(host_offset as usize);
                    let (source, target) = match direction {
                        Direction::Store => (device_at as *const u8, host_at),
                        Direction::Load => (host_at as *const u8, device_at as *mut u8),
                    };
                    std::ptr::copy_nonoverlapping(source, target, page);
                }
                bytes += page as u64;
            }
        }
        Ok(bytes)
    }
}
