//! [`TierArenas`]: the bytes of a shared tier, one host arena per rank (`/kvshm.NAME.host.R`),
//! made by the tier's owner and mapped by every client's copy side (DESIGN §12.2).
//!
//! The owner makes them once and never replaces them while the tier's name is served: a client
//! maps its rank's arena when its engine starts and copies into that mapping for as long as it
//! runs, across restarts of the owner. So:
//! 1. [`TierArenas::create_or_adopt`] (owner) takes over the arenas a previous owner of the name
//!    left, whatever their size (their chunks are the tier's from then on: the `chunks` asked
//!    for apply to a new tier only), or makes them; arenas of another block size are refused,
//!    never removed, since live engines may map them. [`TierArenas::adopt_existing`] takes over
//!    only, at their block size, and makes none: an owner restarted for running engines, whose
//!    mappings are the arenas there are;
//! 2. [`open_rank_arena`] (client) maps one rank's arena and checks it holds the client's
//!    blocks;
//! 3. [`TierArenas::remove`] (owner, when no client has been attached for its idle time) removes
//!    them with the control object, unless a process still maps one
//!    ([`TierArenas::mapped_elsewhere`]: an engine whose copy side started before its scheduler
//!    attached, or one that gave up on this owner): then the owner serves on.
//!
//! A tier whose arenas were taken over holds bytes a client of the previous owner may still be
//! writing (a store prepared before that owner died): the owner hands out no chunk for a store
//! until its store grace has passed ([`super::TierServer::refuse_stores_until`]).

use kvshm_ipc::arena::{Arena, ArenaError, ArenaKind};
use kvshm_ipc::mappers::Mappers;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::shm::ShmError;

/// Why a tier's arenas could not be made, taken over or mapped. Nothing was removed.
#[derive(Debug, thiserror::Error)]
pub enum TierArenaError {
    #[error("the tier's arena of rank {rank}: {source}")]
    Arena { rank: u32, source: ArenaError },
    #[error(
        "tier {tier}'s arena of rank {rank} holds blocks of {found} bytes, and its blocks are \
         {expected} bytes: engines may still map it, so it is left as it is (stop them and \
         `kvctl cleanup {tier}`)"
    )]
    BlockBytes { tier: String, rank: u32, found: u64, expected: u64 },
    #[error(
        "tier {tier}'s arenas disagree: rank 0 holds {first} blocks and rank {rank} {found} \
         (`kvctl cleanup {tier}` once no engine uses it)"
    )]
    Uneven { tier: String, rank: u32, first: u64, found: u64 },
    #[error(
        "tier {tier}'s arena of rank {rank} holds {blocks} blocks, fewer than the {needed} its \
         client needs"
    )]
    TooSmall { tier: String, rank: u32, blocks: u64, needed: u64 },
    #[error(
        "tier {tier} has no arena of rank {rank} to take over (an owner restarted for running \
         engines makes none)"
    )]
    Missing { tier: String, rank: u32 },
}

/// A tier's arenas as its owner holds them (module flow).
#[derive(Debug)]
pub struct TierArenas {
    name: SegmentName,
    arenas: Vec<Arena>,
    adopted: bool,
}

impl TierArenas {
    /// Module flow, step 1: the arenas of `ranks` ranks of tier `name`, blocks of `block_bytes`:
    /// those a previous owner left, taken over with their bytes and their size, or new ones of
    /// `blocks` blocks each.
    ///
    /// # Errors
    /// [`TierArenaError::BlockBytes`] or [`TierArenaError::Uneven`] when arenas of the name are
    /// of another shape (left in place), [`TierArenaError::Arena`] when one cannot be read or
    /// made (a full `/dev/shm`).
    pub fn create_or_adopt(
        name: &SegmentName,
        ranks: u32,
        blocks: u64,
        block_bytes: u64,
    ) -> Result<TierArenas, TierArenaError> {
        Self::take(name, ranks, blocks, block_bytes, true)
    }

    /// Takes over the arenas of `ranks` ranks of tier `name` a previous owner left, at their
    /// size and block size, making none (module flow, step 1).
    ///
    /// # Errors
    /// [`TierArenaError::Missing`] when a rank has none; otherwise as
    /// [`TierArenas::create_or_adopt`].
    pub fn adopt_existing(name: &SegmentName, ranks: u32) -> Result<TierArenas, TierArenaError> {
        let found = survey(name, ranks)?;
        let Some(&(blocks, block_bytes)) = found.iter().flatten().next() else {
            return Err(TierArenaError::Missing { tier: name.as_str().to_owned(), rank: 0 });
        };
        Self::take(name, ranks, blocks, block_bytes, false)
    }

    fn take(
        name: &SegmentName,
        ranks: u32,
        blocks: u64,
        block_bytes: u64,
        create_missing: bool,
    ) -> Result<TierArenas, TierArenaError> {
        let found = survey(name, ranks)?;
        let tier = || name.as_str().to_owned();
        if let Some(rank) = found.iter().position(Option::is_none).filter(|_| !create_missing) {
            return Err(TierArenaError::Missing { tier: tier(), rank: rank as u32 });
        }
        let first = found.iter().flatten().next().map(|&(blocks, _)| blocks);
        for (rank, shape) in found.iter().enumerate() {
            let Some((held, bytes)) = *shape else { continue };
            let rank = rank as u32;
            if bytes != block_bytes {
                return Err(TierArenaError::BlockBytes {
                    tier: tier(),
                    rank,
                    found: bytes,
                    expected: block_bytes,
                });
            }
            if Some(held) != first {
                let first = first.unwrap_or_default();
                return Err(TierArenaError::Uneven { tier: tier(), rank, first, found: held });
            }
        }
        let blocks = first.unwrap_or(blocks);
        let mut arenas = Vec::with_capacity(ranks as usize);
        for (rank, shape) in found.iter().enumerate() {
            let rank = rank as u32;
            let arena = match shape {
                Some(_) => Arena::adopt(name, ArenaKind::Host, rank, blocks, block_bytes).and_then(
                    |arena| {
                        arena.ok_or(ArenaError::Corrupt("the arena changed while it was adopted"))
                    },
                ),
                None => Arena::create(name, ArenaKind::Host, rank, blocks, block_bytes),
            };
            arenas.push(arena.map_err(|source| TierArenaError::Arena { rank, source })?);
        }
        Ok(TierArenas { name: name.clone(), arenas, adopted: first.is_some() })
    }

    /// Blocks of each rank's arena.
    pub fn blocks(&self) -> u64 {
        self.arenas.first().map_or(0, Arena::blocks)
    }

    /// Whether a previous owner's arenas were taken over (their bytes may still be written by
    /// its clients: module documentation).
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Whether a process other than this one maps one of the arenas ([`Mappers`]). Processes
    /// whose maps this user cannot read are not seen: engines run as the owner's user, whose
    /// processes it can read.
    pub fn mapped_elsewhere(&self) -> bool {
        let mappers = Mappers::scan();
        (0..self.arenas.len() as u32)
            .any(|rank| !mappers.of(&ArenaKind::Host.object(&self.name, rank)).is_empty())
    }

    /// Module flow, step 3: removes the arenas and the tier's key table (the tier ends; no
    /// client maps them).
    pub fn remove(self) {
        let ranks = self.arenas.len() as u32;
        drop(self.arenas);
        TierArenas::unlink(&self.name, ranks);
    }

    /// Removes tier `name`'s arenas of `ranks` ranks and its key table, whoever made them (for
    /// tools and tests, once no engine maps them).
    pub fn unlink(name: &SegmentName, ranks: u32) {
        for rank in 0..ranks {
            let _ = Arena::unlink(name, ArenaKind::Host, rank);
        }
        super::TierKeys::unlink(name);
    }
}

/// The shape (blocks, block bytes) of each rank's arena of tier `name`, `None` where there is
/// none.
fn survey(name: &SegmentName, ranks: u32) -> Result<Vec<Option<(u64, u64)>>, TierArenaError> {
    let mut found = Vec::new();
    for rank in 0..ranks {
        match Arena::open(name, ArenaKind::Host, rank) {
            Ok(arena) => found.push(Some((arena.blocks(), arena.block_bytes()))),
            Err(ArenaError::Shm(ShmError::NotFound { .. })) => found.push(None),
            Err(source) => return Err(TierArenaError::Arena { rank, source }),
        }
    }
    Ok(found)
}

/// Module flow, step 2: maps rank `rank`'s arena of tier `name`, checked to hold at least
/// `blocks` blocks of `block_bytes`.
pub fn open_rank_arena(
    name: &SegmentName,
    rank: u32,
    blocks: u64,
    block_bytes: u64,
) -> Result<Arena, TierArenaError> {
    let arena = Arena::open(name, ArenaKind::Host, rank)
        .map_err(|source| TierArenaError::Arena { rank, source })?;
    let tier = || name.as_str().to_owned();
    if arena.block_bytes() != block_bytes {
        return Err(TierArenaError::BlockBytes {
            tier: tier(),
            rank,
            found: arena.block_bytes(),
            expected: block_bytes,
        });
    }
    if arena.blocks() < blocks {
        return Err(TierArenaError::TooSmall {
            tier: tier(),
            rank,
            blocks: arena.blocks(),
            needed: blocks,
        });
    }
    Ok(arena)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> SegmentName {
        SegmentName::new(&format!("arenas-{tag}-{}", std::process::id())).unwrap()
    }

    /// A new owner takes over the arenas a previous one left, bytes and size, whatever it was
    /// asked for; arenas of another block size are refused and left in place.
    #[test]
    fn an_owner_takes_over_the_arenas_left_and_refuses_another_block_size() {
        let name = name("adopt");
        let first = TierArenas::create_or_adopt(&name, 2, 8, 64).unwrap();
        assert!(!first.adopted());
        let client = open_rank_arena(&name, 1, 8, 64).unwrap();
        client.write_data(3 * 64, &[7; 64]).unwrap();
        drop(first);

        let second = TierArenas::create_or_adopt(&name, 2, 100, 64).unwrap();
        assert!(second.adopted());
        assert_eq!(second.blocks(), 8, "the tier keeps the size its arenas have");
        let mut bytes = [0; 64];
        open_rank_arena(&name, 1, 8, 64).unwrap().read_data(3 * 64, &mut bytes).unwrap();
        assert_eq!(bytes, [7; 64], "the bytes stay: the client's mapping is the tier's");
        drop(second);

        let refused = TierArenas::create_or_adopt(&name, 2, 8, 128).unwrap_err();
        assert!(matches!(refused, TierArenaError::BlockBytes { found: 64, expected: 128, .. }));
        assert!(open_rank_arena(&name, 0, 8, 64).is_ok(), "a refused arena stays in place");
        assert!(matches!(
            open_rank_arena(&name, 0, 9, 64),
            Err(TierArenaError::TooSmall { blocks: 8, needed: 9, .. })
        ));
        let arenas = TierArenas::create_or_adopt(&name, 2, 8, 64).unwrap();
        assert!(!arenas.mapped_elsewhere(), "only this process maps them");
        arenas.remove();
        assert!(open_rank_arena(&name, 0, 8, 64).is_err());
    }

    /// An owner restarted for running engines takes over the arenas there are, at their block
    /// size, and makes none where one is missing.
    #[test]
    fn adopting_only_takes_the_arenas_there_are_and_makes_none() {
        let name = name("adopt-only");
        assert!(matches!(
            TierArenas::adopt_existing(&name, 2),
            Err(TierArenaError::Missing { rank: 0, .. })
        ));
        drop(TierArenas::create_or_adopt(&name, 1, 8, 64).unwrap());
        let adopted = TierArenas::adopt_existing(&name, 1).unwrap();
        assert!(adopted.adopted());
        assert_eq!((adopted.blocks(), open_rank_arena(&name, 0, 8, 64).is_ok()), (8, true));
        drop(adopted);
        assert!(matches!(
            TierArenas::adopt_existing(&name, 2),
            Err(TierArenaError::Missing { rank: 1, .. })
        ));
        assert!(open_rank_arena(&name, 1, 8, 64).is_err(), "no arena made for rank 1");
        TierArenas::adopt_existing(&name, 1).unwrap().remove();
    }
}
