//! Planning the offloading worker's copies: an engine's transfer specs turned into block pairs
//! (the in-process copy of those pairs is [`super::tensor_memory`]'s).
//!
//! Core types: [`EngineLayout`] (the shape of one rank's KV tensors and host tier),
//! [`GroupCopy`], [`PlanError`].
//!
//! The host tier holds chunks of `blocks_per_chunk` device blocks; host block `c * k + j` is
//! block `j` of chunk `c`. A host block is block-major: the page of tensor `t` lies at
//! `t * page_bytes` inside it (as kvshm's host tier always is), so a host block is one
//! contiguous unit for a worker process or a storage tier.
//!
//! Planning one transfer ([`EngineLayout::plan`], vLLM's `GPULoadStoreSpec` semantics):
//! 1. the device block ids come grouped by KV-cache group (`group_sizes`); group `g`'s first
//!    block is block `block_indices[g]` of its request, so it lands `block_indices[g] % k`
//!    blocks into its first chunk;
//! 2. group `g` takes `ceil((skip + size) / k)` chunks from the chunk list, in order;
//! 3. device block `i` of the group pairs with host block `chunk[(skip + i) / k] * k +
//!    (skip + i) % k`, and only the tensors of group `g` are copied.
//!
//! Every id is checked against its tier before anything is copied.

use kvshm_ipc::record::BlockPair;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device blocks to host blocks (a store).
    Store,
    /// Host blocks to device blocks (a load).
    Load,
}

/// The shape of one rank's KV tensors and of its host tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLayout {
    /// Bytes of one block of every tensor (equal for all: one host region per tensor).
    pub page_bytes: u64,
    pub tensors: u32,
    pub device_blocks: u32,
    pub chunks: u32,
    pub blocks_per_chunk: u32,
    /// For each KV-cache group, the tensors its blocks live in.
    pub groups: Vec<Vec<u32>>,
    /// The engine's name for how a page lays its bytes out (vLLM's resolved KV cache layout;
    /// empty when the engine names none). Copies never read it; a persistent tier's keys are
    /// taken back only by a tier of the same format ([`super::key_table`]).
    pub page_format: String,
}

/// Why a layout or a transfer spec is refused; nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "a layout needs at least one tensor, one KV-cache group and pages of at least one byte"
    )]
    EmptyLayout,
    #[error("blocks_per_chunk must be at least 1")]
    ZeroBlocksPerChunk,
    #[error("group {group} names tensor {tensor}, but there are {tensors}")]
    TensorOutOfRange { group: usize, tensor: u32, tensors: u32 },
    #[error("{chunks} chunks of {blocks_per_chunk} blocks is more host blocks than a u32 names")]
    TooManyHostBlocks { chunks: u32, blocks_per_chunk: u32 },
    #[error(
        "{host_blocks} host blocks of {tensors} pages of {page_bytes} bytes is more bytes than a \
         u64 counts"
    )]
    TierTooLarge { host_blocks: u32, tensors: u32, page_bytes: u64 },
    #[error("{given} group sizes or block indices for {groups} KV-cache groups")]
    GroupCount { given: usize, groups: usize },
    #[error("the group sizes add up to {sum}, but {blocks} device blocks were given")]
    GroupSizes { sum: u128, blocks: usize },
    #[error("{needed} chunks are needed for the groups' blocks, {given} were given")]
    ChunkCount { needed: u128, given: usize },
    #[error("device block {id} is outside 0..{device_blocks}")]
    DeviceBlockOutOfRange { id: i64, device_blocks: u32 },
    #[error("chunk {id} is outside 0..{chunks}")]
    ChunkOutOfRange { id: i64, chunks: u32 },
    #[error("a negative group size or block index ({value})")]
    Negative { value: i64 },
}

/// The block pairs of one KV-cache group: `src` and `dst` per the transfer's direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupCopy {
    pub group: usize,
    pub pairs: Vec<BlockPair>,
}

impl EngineLayout {
    /// Checks the layout: tensors and groups present, group tensors in range, host blocks
    /// nameable, the tier's bytes countable (so that [`host_block_bytes`](Self::host_block_bytes)
    /// and every offset inside the tier are exact).
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.tensors == 0 || self.groups.is_empty() || self.page_bytes == 0 {
            return Err(PlanError::EmptyLayout);
        }
        if self.blocks_per_chunk == 0 {
            return Err(PlanError::ZeroBlocksPerChunk);
        }
        for (group, tensors) in self.groups.iter().enumerate() {
            if let Some(&tensor) = tensors.iter().find(|&&tensor| tensor >= self.tensors) {
                return Err(PlanError::TensorOutOfRange { group, tensor, tensors: self.tensors });
            }
        }
        self.host_tier_bytes()?;
        Ok(())
    }

    /// Bytes of the whole host tier, or why they cannot be counted.
    pub fn host_tier_bytes(&self) -> Result<u64, PlanError> {
        let host_blocks = self.host_blocks()?;
        self.page_bytes
            .checked_mul(u64::from(self.tensors))
            .and_then(|block| block.checked_mul(u64::from(host_blocks)))
            .ok_or(PlanError::TierTooLarge {
                host_blocks,
                tensors: self.tensors,
                page_bytes: self.page_bytes,
            })
    }

    /// Blocks of the host tier: chunks times blocks per chunk.
    pub fn host_blocks(&self) -> Result<u32, PlanError> {
        self.chunks.checked_mul(self.blocks_per_chunk).ok_or(PlanError::TooManyHostBlocks {
            chunks: self.chunks,
            blocks_per_chunk: self.blocks_per_chunk,
        })
    }

    /// Bytes of one host block: every tensor's page. Exact for a layout that
    /// [`validate`](Self::validate) accepted.
    pub fn host_block_bytes(&self) -> u64 {
        self.page_bytes * u64::from(self.tensors)
    }

    /// The pairs of one transfer, per group (module flow). `device` are the device block ids
    /// grouped by `group_sizes`; `chunks` the host chunks in key order.
    pub fn plan(
        &self,
        direction: Direction,
        device: &[i64],
        group_sizes: &[i64],
        block_indices: &[i64],
        chunks: &[i64],
    ) -> Result<Vec<GroupCopy>, PlanError> {
        let groups = self.groups.len();
        if group_sizes.len() != groups || block_indices.len() != groups {
            let given =
                if group_sizes.len() != groups { group_sizes.len() } else { block_indices.len() };
            return Err(PlanError::GroupCount { given, groups });
        }
        let k = u64::from(self.blocks_per_chunk);
        // The caller's numbers are summed in u128: each term is below 2^64 and there are as many
        // terms as the layout has groups, so no sum can overflow, and a spec whose sizes only
        // add up modulo 2^64 is refused like any other that does not add up.
        let mut sum = 0u128;
        let mut needed_chunks = 0u128;
        for (&size, &index) in group_sizes.iter().zip(block_indices) {
            let size = u128::from(non_negative(size)?);
            let skip = u128::from(non_negative(index)? % k);
            sum += size;
            if size > 0 {
                needed_chunks += (skip + size).div_ceil(u128::from(k));
            }
        }
        if sum != device.len() as u128 {
            return Err(PlanError::GroupSizes { sum, blocks: device.len() });
        }
        if needed_chunks != chunks.len() as u128 {
            return Err(PlanError::ChunkCount { needed: needed_chunks, given: chunks.len() });
        }
        let device_id = |id: i64| {
            u32::try_from(id)
                .ok()
                .filter(|&id| id < self.device_blocks)
                .ok_or(PlanError::DeviceBlockOutOfRange { id, device_blocks: self.device_blocks })
        };
        let chunk_id = |id: i64| {
            u32::try_from(id)
                .ok()
                .filter(|&id| id < self.chunks)
                .ok_or(PlanError::ChunkOutOfRange { id, chunks: self.chunks })
        };
        // From here on every size is at most `device.len()` and every chunk position within
        // `chunks` (the sums above matched), so the indexing below stays in bounds.
        let host_blocks_per_chunk = self.blocks_per_chunk;
        let host_block = |chunk: u32, within: u64| {
            u32::try_from(u64::from(chunk) * u64::from(host_blocks_per_chunk) + within).map_err(
                |_| PlanError::TooManyHostBlocks {
                    chunks: self.chunks,
                    blocks_per_chunk: host_blocks_per_chunk,
                },
            )
        };
        let mut copies = Vec::with_capacity(groups);
        let (mut device_at, mut chunk_at) = (0usize, 0usize);
        for (group, (&size, &index)) in group_sizes.iter().zip(block_indices).enumerate() {
            let size = size as usize;
            if size == 0 {
                continue;
            }
            let skip = (index as u64 % k) as usize;
            let group_chunks = (skip + size).div_ceil(k as usize);
            let mut pairs = Vec::with_capacity(size);
            for i in 0..size {
                let block = device_id(device[device_at + i])?;
                let position = skip + i;
                let chunk = chunk_id(chunks[chunk_at + position / k as usize])?;
                let host = host_block(chunk, position as u64 % k)?;
                pairs.push(match direction {
                    Direction::Store => BlockPair::new(block, host),
                    Direction::Load => BlockPair::new(host, block),
                });
            }
            device_at += size;
            chunk_at += group_chunks;
            copies.push(GroupCopy { group, pairs });
        }
        Ok(copies)
    }
}

fn non_negative(value: i64) -> Result<u64, PlanError> {
    u64::try_from(value).map_err(|_| PlanError::Negative { value })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(blocks_per_chunk: u32, groups: Vec<Vec<u32>>) -> EngineLayout {
        EngineLayout {
            page_bytes: 16,
            tensors: 3,
            device_blocks: 32,
            chunks: 8,
            blocks_per_chunk,
            groups,
            page_format: String::new(),
        }
    }

    #[test]
    fn one_block_per_chunk_pairs_each_device_block_with_its_chunk() {
        let layout = layout(1, vec![vec![0, 1, 2]]);
        let copies = layout.plan(Direction::Store, &[5, 9], &[2], &[4], &[3, 1]).unwrap();
        assert_eq!(
            copies,
            vec![GroupCopy { group: 0, pairs: vec![BlockPair::new(5, 3), BlockPair::new(9, 1)] }]
        );
        let loads = layout.plan(Direction::Load, &[5, 9], &[2], &[4], &[3, 1]).unwrap();
        assert_eq!(loads[0].pairs, vec![BlockPair::new(3, 5), BlockPair::new(1, 9)]);
    }

    #[test]
    fn a_group_starting_inside_a_chunk_skips_to_its_block_there() {
        // 4 blocks per chunk; the group starts at request block 6: 2 blocks into its chunk.
        let layout = layout(4, vec![vec![0], vec![1, 2]]);
        let copies =
            layout.plan(Direction::Load, &[10, 11, 12, 20], &[3, 1], &[6, 0], &[2, 5, 7]).unwrap();
        assert_eq!(
            copies[0].pairs,
            vec![
                BlockPair::new(2 * 4 + 2, 10),
                BlockPair::new(2 * 4 + 3, 11),
                BlockPair::new(5 * 4, 12),
            ]
        );
        assert_eq!((copies[1].group, copies[1].pairs.clone()), (1, vec![BlockPair::new(28, 20)]));
    }

    #[test]
    fn specs_that_do_not_add_up_or_leave_their_tiers_are_refused() {
        let layout = layout(1, vec![vec![0]]);
        let plan = |device: &[i64], sizes: &[i64], chunks: &[i64]| {
            layout.plan(Direction::Store, device, sizes, &[0], chunks)
        };
        assert_eq!(plan(&[1, 2], &[1], &[0]), Err(PlanError::GroupSizes { sum: 1, blocks: 2 }));
        assert_eq!(plan(&[1], &[1], &[0, 1]), Err(PlanError::ChunkCount { needed: 1, given: 2 }));
        assert_eq!(
            plan(&[32], &[1], &[0]),
            Err(PlanError::DeviceBlockOutOfRange { id: 32, device_blocks: 32 })
        );
        assert_eq!(
            plan(&[-1], &[1], &[0]),
            Err(PlanError::DeviceBlockOutOfRange { id: -1, device_blocks: 32 })
        );
        assert_eq!(plan(&[1], &[1], &[8]), Err(PlanError::ChunkOutOfRange { id: 8, chunks: 8 }));
        assert_eq!(plan(&[], &[-1], &[]), Err(PlanError::Negative { value: -1 }));
        assert_eq!(
            layout.plan(Direction::Store, &[1], &[1, 0], &[0], &[0]),
            Err(PlanError::GroupCount { given: 2, groups: 1 })
        );
        // Sizes that add up to the blocks given only modulo 2^64 (four times 2^62 is 0 then).
        let four_groups = self::layout(1, vec![vec![0]; 4]);
        assert_eq!(
            four_groups.plan(Direction::Store, &[], &[1 << 62; 4], &[0; 4], &[]),
            Err(PlanError::GroupSizes { sum: 1 << 64, blocks: 0 })
        );
        let huge = i64::MAX;
        assert_eq!(
            four_groups.plan(Direction::Store, &[], &[huge; 4], &[huge; 4], &[]),
            Err(PlanError::GroupSizes { sum: 4 * huge as u128, blocks: 0 })
        );
    }

    #[test]
    fn layouts_that_name_missing_tensors_or_too_many_host_blocks_are_refused() {
        assert_eq!(
            layout(1, vec![vec![3]]).validate(),
            Err(PlanError::TensorOutOfRange { group: 0, tensor: 3, tensors: 3 })
        );
        let mut huge = layout(1 << 20, vec![vec![0]]);
        huge.chunks = 1 << 20;
        assert!(matches!(huge.validate(), Err(PlanError::TooManyHostBlocks { .. })));
        assert_eq!(layout(1, vec![]).validate(), Err(PlanError::EmptyLayout));
        let mut wide_pages = layout(1, vec![vec![0]]);
        wide_pages.page_bytes = u64::MAX / 2;
        assert_eq!(
            wide_pages.validate(),
            Err(PlanError::TierTooLarge { host_blocks: 8, tensors: 3, page_bytes: u64::MAX / 2 })
        );
    }
}
