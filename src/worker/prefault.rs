//! Faulting a rank's tiers into the worker's page tables before the first copy.
//!
//! A fresh mapping of a shared-memory object has no page-table entries: the first copy to touch a
//! page takes a fault for it (a minor one: the creator backed the object with `posix_fallocate`),
//! and a copy over cold mappings spends most of its time in the kernel. The host backend's worker
//! therefore asks the kernel, once at start-up, to populate its mappings of the device arena and
//! the host tier writable (`MADV_POPULATE_WRITE`, Linux 5.14), so that copies run at memory speed
//! from the first one. The bytes are not touched: populating only maps the pages the object
//! already has, so it is safe while other processes read and write them. Where the creator got
//! huge pages ([`kvshm_ipc::huge_pages`]) each takes one entry, and a tier of GiB maps in within
//! milliseconds; in 4 KiB pages the first touch also zeroes each page, about half a second per
//! GiB.
//!
//! [`populate`]:
//!
//! 1. cut the area into slices of [`POPULATE_SLICE_BYTES`];
//! 2. `madvise(MADV_POPULATE_WRITE)` each slice, heartbeating the claim between slices (a large
//!    host tier takes a while, and the worker already holds its rank);
//! 3. stop early, without failing, on a kernel that does not know the advice or refuses it: the
//!    copies then fault pages in as they go, which is slower but correct.

use super::host_engine::MappedArea;

/// Bytes populated between two heartbeats: about a millisecond of page-table work on an idle
/// machine, and well inside the set-up heartbeat limit on a starved one (16 MiB slices took 30 to
/// 100 ms on a CPU shared with 16 busy processes).
pub const POPULATE_SLICE_BYTES: usize = 4 * 1024 * 1024;

/// How far [`populate`] got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Populated {
    /// Every page of the area is mapped writable.
    All,
    /// The kernel refused the advice after `bytes` bytes (`errno`); the rest faults on first use.
    Partly { bytes: usize, errno: i32 },
}

/// Populates `area`'s pages in this process's page tables (module documentation), calling
/// `between_slices` (the worker heartbeats there) after each slice.
///
/// `area` must start on a page boundary (arena data does); a last partial page is included.
///
/// # Errors
///
/// The first error `between_slices` returns (the worker's: [`ClaimLost`](kvshm_ipc::worker_slot::ClaimLost),
/// the scheduler took the rank away meanwhile).
pub fn populate<E>(
    area: MappedArea,
    mut between_slices: impl FnMut() -> Result<(), E>,
) -> Result<Populated, E> {
    let mut done = 0;
    while done < area.len() {
        let len = (area.len() - done).min(POPULATE_SLICE_BYTES);
        // SAFETY: `done + len <= area.len()`, so the range lies inside the mapping that `area`
        // describes (`MappedArea::new`'s contract); its start is page-aligned (the area's base is,
        // and slices are whole pages). MADV_POPULATE_WRITE only installs page-table entries for
        // the object's existing pages: no byte is read or written, so nothing races with the
        // processes that use the memory.
        let result = unsafe {
            libc::madvise(area.as_ptr().add(done).cast(), len, libc::MADV_POPULATE_WRITE)
        };
        if result != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Ok(Populated::Partly { bytes: done, errno });
        }
        done += len;
        between_slices()?;
    }
    Ok(Populated::All)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshm_ipc::shm::SharedMemory;

    /// Resident kilobytes of this process's mapping that starts at `base` (`/proc/self/smaps`).
    fn resident_kib(base: *mut u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", base as usize);
        let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start)).skip(1);
        let rss = lines.find(|line| line.starts_with("Rss:")).expect("the mapping is listed");
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn populating_maps_every_page_of_a_fresh_mapping_between_heartbeats() {
        let object = format!("/kvshm-test-prefault-{}", std::process::id());
        let len = 2 * POPULATE_SLICE_BYTES + 4096;
        // The creator's mapping may hold the object's huge pages already; a worker's is fresh.
        let _created = SharedMemory::create(&object, len).unwrap();
        let memory = SharedMemory::open(&object).unwrap();
        kvshm_ipc::shm::unlink(&object).unwrap();
        assert_eq!(resident_kib(memory.as_ptr()), 0, "a fresh mapping has no page mapped in");
        // SAFETY: the mapping lives until the end of the test, after the last use of the area.
        let area = unsafe { MappedArea::new(memory.as_ptr(), memory.len()) }.unwrap();
        let mut heartbeats = 0;
        let populated = populate(area, || {
            heartbeats += 1;
            Ok::<(), ()>(())
        });
        assert_eq!(populated, Ok(Populated::All));
        assert_eq!(heartbeats, 3);
        // Every page, give or take a few the kernel may unmap again meanwhile (migration).
        assert!(resident_kib(memory.as_ptr()) > len as u64 / 1024 * 9 / 10);
    }

    #[test]
    fn an_error_between_slices_stops_populating() {
        let object = format!("/kvshm-test-prefault-stop-{}", std::process::id());
        let _created = SharedMemory::create(&object, 2 * POPULATE_SLICE_BYTES).unwrap();
        let memory = SharedMemory::open(&object).unwrap();
        kvshm_ipc::shm::unlink(&object).unwrap();
        // SAFETY: as above.
        let area = unsafe { MappedArea::new(memory.as_ptr(), memory.len()) }.unwrap();
        assert_eq!(populate(area, || Err("rank lost")), Err("rank lost"));
        let slice_kib = POPULATE_SLICE_BYTES as u64 / 1024;
        let resident = resident_kib(memory.as_ptr());
        assert!(resident > slice_kib * 9 / 10 && resident <= slice_kib, "{resident} KiB mapped");
    }
}
