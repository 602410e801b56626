//! Layer-wise progress of in-flight commands: one entry per completion-ring slot of a rank.
//!
//! A command with `FLAG_LAYERWISE` lets the engine start computing on the first layers of a
//! swapped-in block before the whole copy is done. The worker publishes "layers done" for the
//! command in entry `command_id % entries`; since the scheduler never has more commands in flight
//! to a rank than its completion ring holds, no two in-flight commands share an entry.
//!
//! Flow of one command:
//! 1. worker [`LayerProgress::begin`]: layers 0, then the command id with Release;
//! 2. worker [`LayerProgress::publish`] after each layer, with Release;
//! 3. scheduler [`LayerProgress::layers_done`]: id (Acquire), layers (Acquire), id again; a
//!    mismatch means the entry belongs to another command and nothing is reported.

use crate::sync::{AtomicU64, Ordering};

/// One entry as it lies in the segment.
#[repr(C)]
pub struct ProgressEntry {
    command_id: AtomicU64,
    layers_done: AtomicU64,
}

const _: () = assert!(size_of::<ProgressEntry>() == 2 * size_of::<AtomicU64>());

// SAFETY: two AtomicU64 fields with no padding (asserted above); any bits are a valid entry (the
// id check rejects an entry of another command).
unsafe impl crate::shm::SharedArea for ProgressEntry {}

/// A rank's progress table.
#[derive(Clone, Copy)]
pub struct LayerProgress<'a> {
    entries: &'a [ProgressEntry],
}

impl<'a> LayerProgress<'a> {
    /// # Panics
    /// If `entries` is empty: the layout gives every rank one entry per completion slot (at least
    /// two), so this is a programming error.
    pub(crate) fn new(entries: &'a [ProgressEntry]) -> Self {
        assert!(!entries.is_empty(), "an empty progress table is a programming error");
        LayerProgress { entries }
    }

    fn entry(&self, command_id: u64) -> &ProgressEntry {
        &self.entries[(command_id % self.entries.len() as u64) as usize]
    }

    /// Worker: command `command_id` starts; its entry now reads 0 layers done.
    pub fn begin(&self, command_id: u64) {
        let entry = self.entry(command_id);
        entry.layers_done.store(0, Ordering::Relaxed);
        // SYNC: pairs with the Acquire load of command_id in layers_done(): a reader that sees the
        // new id sees layers_done reset.
        entry.command_id.store(command_id, Ordering::Release);
    }

    /// Worker: `layers` layers of command `command_id` are copied.
    pub fn publish(&self, command_id: u64, layers: u32) {
        // SYNC: pairs with the Acquire load of layers_done in layers_done().
        self.entry(command_id).layers_done.store(u64::from(layers), Ordering::Release);
    }

    /// Scheduler: layers done of command `command_id`, or `None` if its worker has not begun it.
    pub fn layers_done(&self, command_id: u64) -> Option<u32> {
        let entry = self.entry(command_id);
        // SYNC: pairs with the Release store of command_id in begin().
        if entry.command_id.load(Ordering::Acquire) != command_id {
            return None;
        }
        // SYNC: pairs with the Release store in publish(); a value published for a later command
        // in this entry makes the re-check below see that command's id.
        let layers = entry.layers_done.load(Ordering::Acquire);
        (entry.command_id.load(Ordering::Relaxed) == command_id)
            .then(|| layers.min(u32::MAX.into()) as u32)
    }

    /// Scheduler, during reclaim: forget every entry.
    pub fn clear(&self) {
        for entry in self.entries {
            entry.command_id.store(0, Ordering::Relaxed);
            entry.layers_done.store(0, Ordering::Relaxed);
        }
    }

    pub fn entries(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_reported_only_for_the_command_that_owns_the_entry() {
        let entries: Vec<ProgressEntry> = (0..4)
            .map(|_| ProgressEntry {
                command_id: AtomicU64::new(0),
                layers_done: AtomicU64::new(0),
            })
            .collect();
        let progress = LayerProgress::new(&entries);
        assert_eq!(progress.layers_done(5), None);
        progress.begin(5);
        assert_eq!(progress.layers_done(5), Some(0));
        progress.publish(5, 3);
        assert_eq!(progress.layers_done(5), Some(3));
        // Command 9 reuses entry 1 after 5 completed.
        progress.begin(9);
        assert_eq!(progress.layers_done(5), None);
        assert_eq!(progress.layers_done(9), Some(0));
        progress.clear();
        assert_eq!(progress.layers_done(9), None);
    }
}
