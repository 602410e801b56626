//! The storage lane's answers, run over a scripted back-end.

use super::*;
use crate::storage::{BackendStats, BlockLayout, ContainsOutcome};
use crate::worker::geometry::GeometryParams;
use kvshm_ipc::storage_record::{tier_unreachable, StorageEntry};

/// A back-end that answers every put and get with the outcomes it was given.
struct Scripted {
    puts: Vec<PutOutcome>,
    gets: Vec<GetOutcome>,
}

impl StorageBackend for Scripted {
    fn kind(&self) -> &'static str {
        "scripted"
    }
    fn is_shared(&self) -> bool {
        false
    }
    fn layout(&self) -> BlockLayout {
        BlockLayout::new(BLOCK_BYTES as u64, 1, 1).unwrap()
    }
    fn put(&mut self, _: &[PutBlock<'_>], outcomes: &mut Vec<PutOutcome>) {
        outcomes.clone_from(&self.puts);
    }
    fn get(&mut self, _: &mut [GetBlock<'_>], outcomes: &mut Vec<GetOutcome>) {
        outcomes.clone_from(&self.gets);
    }
    fn contains(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<ContainsOutcome>) {
        outcomes.clear();
        outcomes.resize(hashes.len(), Ok(false));
    }
    fn remove(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        outcomes.clear();
        outcomes.resize(hashes.len(), Ok(()));
    }
    fn forget(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        self.remove(hashes, outcomes);
    }
    fn sync(&mut self) -> Result<(), Failure> {
        Ok(())
    }
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}

const BLOCK_BYTES: usize = 64;

/// Runs a two-block `op` on a back-end that answers `puts` and `gets`, over two host blocks.
fn run(op: StorageOp, puts: Vec<PutOutcome>, gets: Vec<GetOutcome>) -> Completion {
    let mut memory = vec![0u8; 2 * BLOCK_BYTES];
    let params = GeometryParams {
        layers: 1,
        regions: 1,
        region_bytes: BLOCK_BYTES as u64,
        device_blocks: 1,
        host_blocks: 2,
    };
    let geometry = Geometry::new(params).unwrap();
    // SAFETY: `memory` is mapped, readable and writable, outlives `host` (both end with this
    // function), and only this thread touches it.
    let area = unsafe { MappedArea::new(memory.as_mut_ptr(), memory.len()) }.unwrap();
    let host = HostBlocks::new(area, &geometry).unwrap();
    let entries = vec![StorageEntry::new(1, 0, 0, 0), StorageEntry::new(2, 1, 1, 1)];
    let command = StorageCommand { op, entries };
    let mut backend = Scripted { puts, gets };
    Runner::default().run(&mut backend, &host, &command).completion(7, 3)
}

/// A STORE or LOAD that could not reach the tier for one block is flagged so, however many
/// of its other blocks landed: per-entry bits mixing landed and failed blocks would tell the
/// scheduler of one bad block, which it drops, where the tier was failing (a part of a Redis
/// pipeline timed out, a connection dropped). A block's own fault (an I/O error on one slot,
/// a full tier, a corrupt or absent record) is not.
#[test]
fn an_unreachable_tier_is_flagged_and_a_bad_block_is_not() {
    let io = || Failure::Io("EIO".into());
    let landed_then_failed = StorageResults { done: 0b01, failed: 0b10 };
    for (failure, unreachable) in
        [(Failure::Timeout, true), (Failure::Unavailable, true), (io(), false)]
    {
        let load = run(StorageOp::Load, vec![], vec![Ok(()), Err(GetMiss::Failed(failure))]);
        assert!(load.is_ok() && (load.command_id, load.generation) == (7, 3), "{load:?}");
        assert_eq!(StorageResults::from_detail(load.detail), landed_then_failed);
        assert_eq!(tier_unreachable(&load), unreachable, "{load:?}");
    }
    for (failure, unreachable) in
        [(Failure::Timeout, true), (Failure::Unavailable, true), (io(), false)]
    {
        let store = run(StorageOp::Store, vec![Ok(()), Err(failure)], vec![]);
        assert_eq!(StorageResults::from_detail(store.detail), landed_then_failed);
        assert_eq!(tier_unreachable(&store), unreachable, "{store:?}");
    }
    // A full tier refused a block: not written, not failed, not unreachable.
    let full = run(StorageOp::Store, vec![Ok(()), Err(Failure::NoSpace)], vec![]);
    assert_eq!(StorageResults::from_detail(full.detail), StorageResults { done: 1, failed: 0 });
    assert!(!tier_unreachable(&full));
    // An absent or corrupt record: a miss, neither failed nor unreachable.
    for miss in [GetMiss::Absent, GetMiss::Corrupt] {
        let load = run(StorageOp::Load, vec![], vec![Ok(()), Err(miss)]);
        assert_eq!(StorageResults::from_detail(load.detail), StorageResults { done: 1, failed: 0 });
        assert!(!tier_unreachable(&load));
    }
}
