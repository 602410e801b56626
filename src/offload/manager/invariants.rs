//! [`OffloadManager::check_invariants`]: the agreements between the pool, the index, the arena's
//! links and the eviction heap, checked from scratch (tests call it after every operation).

use std::collections::{HashMap, HashSet};

use super::{OffloadManager, NONE};
use crate::offload::candidates::Rank;

impl OffloadManager {
    /// Checks the manager's internal agreements; a violation is a bug in this module.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check()?;
        if self.pool.used_count() != self.live + self.taken as usize {
            return Err(format!(
                "{} chunks in use for {} keys and {} taken",
                self.pool.used_count(),
                self.live,
                self.taken
            ));
        }
        let mut chunks = HashSet::new();
        let mut children: HashMap<u32, u32> = HashMap::new();
        let mut indexed = 0;
        for (&hash, &head) in &self.heads {
            let mut id = head;
            while id != NONE {
                let entry = self.entries.get(id as usize).ok_or("an index entry out of range")?;
                if !entry.live || entry.key.hash64() != hash {
                    return Err(format!("entry {id} is chained under the wrong hash, or dead"));
                }
                indexed += 1;
                id = entry.same_hash;
            }
        }
        let live_ids: Vec<u32> =
            (0u32..).zip(&self.entries).filter(|(_, entry)| entry.live).map(|(id, _)| id).collect();
        if indexed != self.live || live_ids.len() != self.live {
            return Err(format!(
                "{indexed} entries indexed, {} live, {} counted",
                live_ids.len(),
                self.live
            ));
        }
        for &id in &live_ids {
            let entry = &self.entries[id as usize];
            let key = entry.key;
            if self.find(&key) != Some(id) {
                return Err(format!("{key:?} is not found at its entry {id}"));
            }
            if !self.pool.is_used(entry.chunk) || !chunks.insert(entry.chunk) {
                return Err(format!("chunk {} of {key:?} is free or shared", entry.chunk));
            }
            if !entry.ready && entry.pins > 0 {
                return Err(format!("{key:?} is pinned by a load before its store completed"));
            }
            if entry.parent != NONE {
                if !self.entries[entry.parent as usize].live {
                    return Err(format!("{key:?} names a parent that is not cached"));
                }
                *children.entry(entry.parent).or_insert(0) += 1;
            }
        }
        let records: HashSet<(Rank, u32)> = self.candidates.records().collect();
        for &id in &live_ids {
            let entry = &self.entries[id as usize];
            let counted = children.get(&id).copied().unwrap_or(0);
            let mut listed = 0;
            let mut child = entry.first_child;
            while child != NONE {
                if self.entries[child as usize].parent != id {
                    return Err(format!("{:?} lists a child that is not its own", entry.key));
                }
                listed += 1;
                child = self.entries[child as usize].next_sibling;
            }
            if entry.children != counted || listed != counted {
                return Err(format!(
                    "{:?} counts {} children, lists {listed}, has {counted}",
                    entry.key, entry.children
                ));
            }
            if self.is_candidate(id, 0) && !records.contains(&(entry.rank, id)) {
                return Err(format!("candidate {:?} has no current record", entry.key));
            }
        }
        Ok(())
    }
}
