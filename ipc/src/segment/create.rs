//! Reading and validating a control object's header, and creating a new one with its arenas.

use std::ptr::addr_of;

use super::{AttachError, CorruptReason, CreateError, CREATE_ATTEMPTS};
use crate::arena::{Arena, ArenaKind};
use crate::config::{Backend, SegmentConfig};
use crate::inspect::{self, ObjectIdentity};
use crate::layout::{
    Header, HeaderFields, RecordSizes, SegmentLayout, LAYOUT_VERSION, MAGIC, READY,
};
use crate::listing::{self, ExistingSegment};
use crate::liveness::ProcessIdentity;
use crate::name::SegmentName;
use crate::shm::{SharedMemory, ShmError};
use crate::sync::{AtomicU32, Ordering};

/// Offset of the creator identity in the header (written first during creation).
pub(super) const CREATOR_OFFSET: usize = std::mem::offset_of!(HeaderFields, creator);

pub(super) fn header_fields_ptr(memory: &SharedMemory) -> *mut HeaderFields {
    memory.as_ptr().cast::<HeaderFields>()
}

/// The header's `ready` word.
///
/// # Panics
/// If the mapping is shorter than a [`Header`]: callers check the length first (attach) or made
/// the mapping (create), so that is a programming error.
pub(super) fn header_ready(memory: &SharedMemory) -> &AtomicU32 {
    assert!(memory.len() >= size_of::<Header>(), "a mapping shorter than a header");
    let header = memory.as_ptr().cast::<Header>();
    // SAFETY: 1. the mapping is page-aligned and holds a whole Header (asserted above), and lives
    // as long as `memory`; 2. the reference covers the ready atomic alone (a raw projection, never
    // a reference to the Header, whose plain fields another process may write), so every access
    // through it is atomic and any bits are a valid u32.
    unsafe { &*addr_of!((*header).ready) }
}

/// The creator identity of a control object, if it is long enough and the identity was written.
pub(crate) fn read_creator(memory: &SharedMemory) -> Option<ProcessIdentity> {
    if memory.len() < CREATOR_OFFSET + size_of::<ProcessIdentity>() {
        return None;
    }
    // SAFETY: 1. in bounds (checked above); 2. the offset is 8-aligned in a page-aligned mapping;
    // 3. a volatile copy of a Pod: any bytes are a value, read once. The creator writes these
    // bytes before anything else and never again (trusted peer: a process writing them while
    // they are copied gets a torn identity judged like any other, never more).
    let creator =
        unsafe { memory.as_ptr().add(CREATOR_OFFSET).cast::<ProcessIdentity>().read_volatile() };
    (!creator.is_none()).then_some(creator)
}

/// Checks everything in a control object except the creator's liveness.
pub(crate) fn validate_header(
    memory: &SharedMemory,
) -> Result<(HeaderFields, SegmentLayout), AttachError> {
    let len = memory.len() as u64;
    let header_size = size_of::<Header>() as u64;
    if len < header_size {
        return Err(AttachError::Truncated { len, expected: header_size });
    }
    // SAFETY: 1. the mapping holds a whole Header (checked above) and is page-aligned; 2. a
    // volatile copy reads the bytes once, as they are (HeaderFields is Pod, so any bytes are a
    // value), and nothing is trusted before it is checked. The premise is a trusted peer: another
    // process writing the header while it is copied makes the copy torn, and the race its breach
    // (a creator writes it only before READY).
    let early = unsafe { header_fields_ptr(memory).read_volatile() };
    if early.magic == MAGIC && early.layout_version != LAYOUT_VERSION {
        return Err(AttachError::VersionMismatch {
            found: early.layout_version,
            expected: LAYOUT_VERSION,
        });
    }
    // SYNC: pairs with the Release store of ready in Segment::create().
    if header_ready(memory).load(Ordering::Acquire) != READY {
        return Err(AttachError::NotReady { pid: early.creator.pid });
    }
    // SAFETY: as for `early`; read again after the Acquire so that the copy is the published one.
    let fields = unsafe { header_fields_ptr(memory).read_volatile() };
    if fields.magic != MAGIC {
        return Err(AttachError::BadMagic);
    }
    if fields.layout_version != LAYOUT_VERSION {
        return Err(AttachError::VersionMismatch {
            found: fields.layout_version,
            expected: LAYOUT_VERSION,
        });
    }
    if let Some((record, found, expected)) =
        fields.record_sizes.first_mismatch(&RecordSizes::CURRENT)
    {
        return Err(AttachError::RecordSizeMismatch { record, found, expected });
    }
    if fields.total_size > len {
        return Err(AttachError::Truncated { len, expected: fields.total_size });
    }
    let layout = SegmentLayout::compute(&fields.config)
        .map_err(|error| AttachError::Corrupt(CorruptReason::Config(error)))?;
    if let Some((area, found, expected)) = layout.first_offset_mismatch(&fields.offsets) {
        return Err(AttachError::Corrupt(CorruptReason::Offset { area, found, expected }));
    }
    if fields.total_size != layout.total_size as u64 {
        return Err(AttachError::Corrupt(CorruptReason::TotalSize {
            found: fields.total_size,
            expected: layout.total_size as u64,
        }));
    }
    Ok((fields, layout))
}

/// Step 2 of creation: make the control object, taking over a stale one.
pub(crate) fn create_control_object(
    name: &SegmentName,
    object: &str,
    len: usize,
) -> Result<SharedMemory, CreateError> {
    for _ in 0..CREATE_ATTEMPTS {
        match SharedMemory::create(object, len) {
            Ok(memory) => return Ok(memory),
            Err(ShmError::AlreadyExists { .. }) => match listing::judge_existing(object)? {
                ExistingSegment::Live { pid } => return Err(CreateError::InUse { pid }),
                ExistingSegment::BeingCreated => {
                    return Err(CreateError::BeingCreated { object: object.to_owned() })
                }
                ExistingSegment::Stale { identity } => {
                    tracing::info!(segment = %name, "removing stale segment before creating it anew");
                    // The very file judged stale, not the name: two creators may judge one stale
                    // object at once, and the second must not remove what the first made since.
                    // Its data objects go in step 3, once the control object is ours.
                    inspect::unlink_if_identical(object, identity)?;
                }
                ExistingSegment::Gone => {}
            },
            Err(error) => return Err(error.into()),
        }
    }
    Err(CreateError::BeingCreated { object: object.to_owned() })
}

/// Step 3 of creation: the data arenas, after removing orphans of the name (we hold the control
/// object, so any data object of the name left over belongs to a dead creator). With
/// `keep_host`, a host tier arena left over with this configuration's blocks is taken over, its
/// bytes kept (one of another size is replaced); returns, per rank, whether its host tier was
/// kept.
pub(super) fn create_arenas(
    name: &SegmentName,
    config: &SegmentConfig,
    created: &mut Vec<(String, ObjectIdentity)>,
    keep_host: bool,
) -> Result<Vec<bool>, CreateError> {
    listing::unlink_data_objects_but(name, keep_host)?;
    let mut kept = vec![false; config.tp_size as usize];
    let block_bytes = config.block_bytes();
    for rank in 0..config.tp_size {
        if config.backend()? == Backend::HostArena {
            let arena = Arena::create(
                name,
                ArenaKind::Device,
                rank,
                config.device_blocks.into(),
                block_bytes,
            )?;
            created.push((name.device_arena_object(rank), arena.identity()?));
        }
        // A shared tier's arenas are its owner's (DESIGN §12.2): the segment makes none.
        if config.host_blocks > 0 && !config.host_tier_is_shared() {
            let blocks = config.host_blocks.into();
            let adopted = if keep_host {
                Arena::adopt(name, ArenaKind::Host, rank, blocks, block_bytes)?
            } else {
                None
            };
            kept[rank as usize] = adopted.is_some();
            let arena = match adopted {
                Some(arena) => arena,
                None => Arena::create(name, ArenaKind::Host, rank, blocks, block_bytes)?,
            };
            created.push((name.host_tier_object(rank), arena.identity()?));
        }
    }
    Ok(kept)
}
