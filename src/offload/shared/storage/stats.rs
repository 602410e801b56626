//! [`TierStorageStats`]: what the storage tier below a shared tier holds, has in flight and
//! has done, as the owner prints it at its end and publishes it after each turn (as the words of
//! the control object's `StorageStats`, which `kvctl tier` reads back).

use kvshm_ipc::tier_control::STORAGE_FIGURES;
use serde::Serialize;

/// What the storage tier has done and has in flight, for the owner's log and `kvctl tier` (the
/// owner publishes it in the tier's control object as words: `StorageStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStorageStats {
    /// Keys every rank's storage held when the owner started, and known to be held now.
    pub held_at_start: u64,
    pub held: u64,
    /// Keys being written, waiting to be written, being brought back.
    pub writing: u64,
    pub waiting: u64,
    pub promoting: u64,
    /// Keys written through, and those a rank failed to write.
    pub puts: u64,
    pub puts_failed: u64,
    /// Keys dropped unwritten from a queue of writes longer than the tier (the storage is
    /// behind).
    pub puts_skipped: u64,
    /// Keys brought back into the arenas, those a rank no longer had, and those the back-end
    /// failed to read (it may still hold them).
    pub promoted: u64,
    pub promotions_missed: u64,
    pub promotions_failed: u64,
    /// Promotions that found no chunk to evict.
    pub promotions_refused: u64,
}

impl TierStorageStats {
    /// The words the owner publishes, in the fields' order (the rest zero).
    pub fn to_words(&self) -> [u64; STORAGE_FIGURES] {
        let figures = [
            self.held_at_start,
            self.held,
            self.writing,
            self.waiting,
            self.promoting,
            self.puts,
            self.puts_failed,
            self.puts_skipped,
            self.promoted,
            self.promotions_missed,
            self.promotions_refused,
            self.promotions_failed,
        ];
        let mut words = [0; STORAGE_FIGURES];
        words[..figures.len()].copy_from_slice(&figures);
        words
    }

    /// The figures [`TierStorageStats::to_words`] published.
    pub fn from_words(words: &[u64; STORAGE_FIGURES]) -> TierStorageStats {
        // A struct expression evaluates its fields in the order written: `to_words`' order.
        let mut words = words.iter().copied();
        let mut next = || words.next().unwrap_or_default();
        TierStorageStats {
            held_at_start: next(),
            held: next(),
            writing: next(),
            waiting: next(),
            promoting: next(),
            puts: next(),
            puts_failed: next(),
            puts_skipped: next(),
            promoted: next(),
            promotions_missed: next(),
            promotions_refused: next(),
            promotions_failed: next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures come back from the words the owner publishes, each in its own field.
    #[test]
    fn the_published_words_give_back_every_figure() {
        let stats = TierStorageStats {
            held_at_start: 1,
            held: 2,
            writing: 3,
            waiting: 4,
            promoting: 5,
            puts: 6,
            puts_failed: 7,
            puts_skipped: 8,
            promoted: 9,
            promotions_missed: 10,
            promotions_refused: 11,
            promotions_failed: 12,
        };
        assert_eq!(TierStorageStats::from_words(&stats.to_words()), stats);
    }
}
