//! A pool of block ids `0..capacity` for one memory tier (device or host).
//!
//! The pool only hands out and takes back numbers; what a block holds and who owns it is the cache
//! manager's business. Every operation costs O(1) per block: the free ids sit in a stack, and each
//! id knows its position in that stack (or that it is in use), so freeing, checking and taking a
//! specific id never search.
//!
//! Core type: [`BlockPool`]. Taking `n` blocks ([`BlockPool::allocate`]):
//! 1. refuse unless `n` ids are free (all-or-nothing, the pool unchanged);
//! 2. pop `n` ids off the free stack and mark each in use.
//!
//! Freeing validates every id first (in range, in use, not repeated) and changes nothing on error.

/// Position marker of an id that is in use.
const IN_USE: u32 = u32::MAX;

/// Not enough free blocks for an all-or-nothing allocation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{requested} blocks requested but only {free} are free")]
pub struct OutOfBlocks {
    pub requested: usize,
    pub free: usize,
}

/// A block id that cannot be given back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    #[error("block {id} is out of range (capacity {capacity})")]
    OutOfRange { id: u32, capacity: u32 },
    #[error("block {id} is not in use")]
    NotInUse { id: u32 },
}

/// A block id that cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeError {
    #[error("block {id} is out of range (capacity {capacity})")]
    OutOfRange { id: u32, capacity: u32 },
    #[error("block {id} is already in use")]
    InUse { id: u32 },
}

/// The most blocks a pool holds: ids are u32, and one value marks an id in use.
pub const MAX_POOL_BLOCKS: u32 = u32::MAX - 1;

/// A capacity beyond what a pool's u32 ids can name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{capacity} blocks is more than the {MAX_POOL_BLOCKS} a pool's u32 ids can name")]
pub struct TooManyBlocks {
    pub capacity: u32,
}

/// A capacity a pool cannot be resized to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    #[error(transparent)]
    TooManyBlocks(#[from] TooManyBlocks),
    /// A shrink that would cut off blocks in use.
    #[error("cannot shrink to {capacity} blocks: block {first_in_use} is in use")]
    BlocksInUse { capacity: u32, first_in_use: u32 },
}

/// The free and used ids of one tier.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Free ids; allocation pops from the end.
    free: Vec<u32>,
    /// For each id, its index in `free`, or [`IN_USE`].
    position: Vec<u32>,
}

impl BlockPool {
    /// A pool of `capacity` free blocks (at most [`MAX_POOL_BLOCKS`]). Block 0 is handed out
    /// first.
    pub fn new(capacity: u32) -> Result<BlockPool, TooManyBlocks> {
        check_capacity(capacity)?;
        let mut pool = BlockPool { free: Vec::new(), position: Vec::new() };
        pool.grow_to(capacity);
        Ok(pool)
    }

    pub fn capacity(&self) -> u32 {
        self.position.len() as u32
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.position.len() - self.free.len()
    }

    /// Whether `id` is in range and free.
    pub fn is_free(&self, id: u32) -> bool {
        self.position.get(id as usize).is_some_and(|&position| position != IN_USE)
    }

    /// Whether `id` is in range and in use.
    pub fn is_used(&self, id: u32) -> bool {
        self.position.get(id as usize).is_some_and(|&position| position == IN_USE)
    }

    /// Takes `n` free blocks, appending them to `out`; all or nothing.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<u32>) -> Result<(), OutOfBlocks> {
        if n > self.free.len() {
            return Err(OutOfBlocks { requested: n, free: self.free.len() });
        }
        let start = self.free.len() - n;
        for &id in self.free[start..].iter().rev() {
            self.position[id as usize] = IN_USE;
            out.push(id);
        }
        self.free.truncate(start);
        Ok(())
    }

    /// Takes `n` free blocks; all or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, OutOfBlocks> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    /// Takes one free block.
    pub fn allocate_one(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.position[id as usize] = IN_USE;
        Some(id)
    }

    /// Takes the specific block `id`, which must be free.
    pub fn take(&mut self, id: u32) -> Result<(), TakeError> {
        match self.position.get(id as usize) {
            None => Err(TakeError::OutOfRange { id, capacity: self.capacity() }),
            Some(&IN_USE) => Err(TakeError::InUse { id }),
            Some(&position) => {
                self.remove_from_free(position);
                self.position[id as usize] = IN_USE;
                Ok(())
            }
        }
    }

    /// Gives one block back.
    pub fn free(&mut self, id: u32) -> Result<(), FreeError> {
        match self.position.get(id as usize) {
            None => Err(FreeError::OutOfRange { id, capacity: self.capacity() }),
            Some(&IN_USE) => {
                self.position[id as usize] = self.free.len() as u32;
                self.free.push(id);
                Ok(())
            }
            Some(_) => Err(FreeError::NotInUse { id }),
        }
    }

    /// Gives blocks back, in the order given (the last one given back is handed out first); on
    /// error (an id out of range, free, or repeated) nothing is freed.
    pub fn free_all(&mut self, ids: &[u32]) -> Result<(), FreeError> {
        for (done, &id) in ids.iter().enumerate() {
            if let Err(error) = self.free(id) {
                for &undo in ids[..done].iter().rev() {
                    self.take(undo).expect("re-taking an id just freed is a programming error");
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Marks every block free.
    pub fn clear(&mut self) {
        let capacity = self.capacity();
        self.free.clear();
        self.position.clear();
        self.grow_to(capacity);
    }

    /// Grows to `capacity`, or shrinks to it when every id at or above `capacity` is free.
    /// Costs O(1) per block added or removed.
    pub fn resize(&mut self, capacity: u32) -> Result<(), ResizeError> {
        check_capacity(capacity)?;
        let old = self.capacity();
        if capacity >= old {
            self.grow_to(capacity);
            return Ok(());
        }
        if let Some(first_in_use) = (capacity..old).find(|&id| self.is_used(id)) {
            return Err(ResizeError::BlocksInUse { capacity, first_in_use });
        }
        for id in capacity..old {
            let position = self.position[id as usize];
            self.remove_from_free(position);
        }
        self.position.truncate(capacity as usize);
        Ok(())
    }

    /// Iterates the free ids (in no particular order).
    pub fn free_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter().copied()
    }

    /// Bytes of heap memory this pool holds.
    pub fn heap_bytes(&self) -> usize {
        (self.free.capacity() + self.position.capacity()) * size_of::<u32>()
    }

    /// Checks that the free and used ids are disjoint and cover `0..capacity` (DESIGN §6,
    /// invariant 1).
    pub fn check(&self) -> Result<(), String> {
        for (index, &id) in self.free.iter().enumerate() {
            if self.position.get(id as usize) != Some(&(index as u32)) {
                return Err(format!("free id {id} at stack index {index} has a wrong position"));
            }
        }
        let marked_free = self.position.iter().filter(|&&position| position != IN_USE).count();
        if marked_free != self.free.len() {
            return Err(format!(
                "{marked_free} ids marked free but {} on the stack",
                self.free.len()
            ));
        }
        Ok(())
    }

    fn grow_to(&mut self, capacity: u32) {
        // Push the new ids highest first so that the lowest is handed out first.
        let old = self.capacity();
        self.position.resize(capacity as usize, IN_USE);
        // Exactly: pushing one at a time would double the stack's capacity, up to twice the ids.
        self.free.reserve_exact((capacity - old) as usize);
        for id in (old..capacity).rev() {
            self.position[id as usize] = self.free.len() as u32;
            self.free.push(id);
        }
    }

    /// Removes the entry at `position` of the free stack by swapping the last entry into it.
    fn remove_from_free(&mut self, position: u32) {
        let last =
            self.free.pop().expect("removing from an empty free stack is a programming error");
        if position as usize != self.free.len() {
            self.free[position as usize] = last;
            self.position[last as usize] = position;
        }
    }
}

fn check_capacity(capacity: u32) -> Result<(), TooManyBlocks> {
    if capacity > MAX_POOL_BLOCKS {
        return Err(TooManyBlocks { capacity });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut pool = BlockPool::new(4).unwrap();
        assert_eq!(pool.allocate(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(pool.allocate(2), Err(OutOfBlocks { requested: 2, free: 1 }));
        assert_eq!(pool.free_count(), 1);
        pool.check().unwrap();
    }

    #[test]
    fn freeing_a_free_block_is_an_error_that_changes_nothing() {
        let mut pool = BlockPool::new(4).unwrap();
        let ids = pool.allocate(2).unwrap();
        pool.free(ids[0]).unwrap();
        assert_eq!(pool.free(ids[0]), Err(FreeError::NotInUse { id: ids[0] }));
        assert_eq!(pool.free(9), Err(FreeError::OutOfRange { id: 9, capacity: 4 }));
        assert_eq!(pool.free_count(), 3);
        pool.check().unwrap();
    }

    #[test]
    fn freeing_a_batch_with_a_repeated_id_frees_nothing() {
        let mut pool = BlockPool::new(4).unwrap();
        let ids = pool.allocate(3).unwrap();
        assert_eq!(
            pool.free_all(&[ids[0], ids[1], ids[0]]),
            Err(FreeError::NotInUse { id: ids[0] })
        );
        assert_eq!(pool.free_count(), 1);
        assert!(pool.is_used(ids[0]) && pool.is_used(ids[1]));
        pool.check().unwrap();
    }

    #[test]
    fn the_last_block_freed_is_handed_out_first() {
        let mut pool = BlockPool::new(4).unwrap();
        let ids = pool.allocate(4).unwrap();
        pool.free_all(&[ids[3], ids[1]]).unwrap();
        assert_eq!(pool.allocate_one(), Some(ids[1]));
    }

    #[test]
    fn a_specific_free_block_can_be_taken() {
        let mut pool = BlockPool::new(4).unwrap();
        pool.take(2).unwrap();
        assert_eq!(pool.take(2), Err(TakeError::InUse { id: 2 }));
        let mut rest = pool.allocate(3).unwrap();
        rest.sort_unstable();
        assert_eq!(rest, vec![0, 1, 3]);
        pool.check().unwrap();
    }

    #[test]
    fn resize_grows_always_and_shrinks_only_over_free_blocks() {
        let mut pool = BlockPool::new(4).unwrap();
        pool.take(2).unwrap();
        pool.resize(8).unwrap();
        assert_eq!(pool.free_count(), 7);
        assert_eq!(pool.resize(2), Err(ResizeError::BlocksInUse { capacity: 2, first_in_use: 2 }));
        assert_eq!(pool.capacity(), 8);
        pool.resize(3).unwrap();
        assert_eq!((pool.capacity(), pool.free_count()), (3, 2));
        pool.check().unwrap();
        pool.free(2).unwrap();
        pool.resize(0).unwrap();
        assert_eq!(pool.allocate_one(), None);
    }

    #[test]
    fn a_capacity_beyond_the_id_space_is_a_typed_error() {
        assert_eq!(BlockPool::new(u32::MAX).unwrap_err(), TooManyBlocks { capacity: u32::MAX });
        let mut pool = BlockPool::new(4).unwrap();
        assert_eq!(
            pool.resize(u32::MAX),
            Err(ResizeError::TooManyBlocks(TooManyBlocks { capacity: u32::MAX }))
        );
        assert_eq!((pool.capacity(), pool.free_count()), (4, 4));
        pool.check().unwrap();
    }

    #[test]
    fn clear_frees_every_block() {
        let mut pool = BlockPool::new(5).unwrap();
        pool.allocate(4).unwrap();
        pool.clear();
        assert_eq!(pool.free_count(), 5);
        pool.check().unwrap();
    }
}
