//! Huge pages for shared-memory objects: backing a new object with them where the kernel gives
//! them, mapping objects where a huge page can be mapped whole, and telling how much of a mapping
//! is.
//!
//! A host tier in 4 KiB pages costs one page-table entry per page in every process that maps it,
//! and both the worker's pre-fault and its exit (the kernel's teardown of those entries) grow with
//! the tier: about a second per 8 GiB on an idle machine, several under load. In huge pages (the
//! size one PMD entry maps: 2 MiB on x86-64) there are 512 times fewer entries to make and undo.
//!
//! Where the kernel gives them: `/dev/shm` is usually mounted without huge pages (`huge=never`)
//! and `shmem_enabled` often says `never`; both are the operator's settings. `MADV_COLLAPSE`
//! (Linux 6.1) asks for a huge page over one PMD-sized range of a mapping whatever those say; the
//! kernel still refuses it with `shmem_enabled=deny`, in a process that turned huge pages off
//! ([`refuse_in_this_process`], `prctl(PR_SET_THP_DISABLE)`), without transparent huge pages, and
//! when no huge page can be had (fragmented memory).
//!
//! `back_with_huge_pages`, from [`SharedMemory::create`](crate::shm::SharedMemory::create) on
//! its own mapping of the new, empty object:
//!
//! 1. if the object does not fit in the file system's free space, do nothing: `posix_fallocate`
//!    then fails at once, instead of after filling `/dev/shm` with huge pages;
//! 2. back the first 4 KiB of each whole PMD-sized chunk (`fallocate`): the kernel collapses only
//!    chunks that hold a page;
//! 3. `MADV_COLLAPSE` all whole chunks in one call: the kernel puts a huge page in each (the small
//!    page copied, the rest zeroed) and maps it, and stops at the first it cannot have;
//! 4. report the bytes now mapped by huge pages (this mapping's `smaps`) and the refusal, if any;
//!    the caller backs the rest with small pages.
//!
//! `Mapping::new`: a huge page is mapped by one PMD entry only where the virtual address and the
//! file offset agree modulo its size, so every mapping starts on a PMD boundary (reserve its
//! length plus one PMD of address space, map the object over the aligned part, release the rest).
//!
//! [`mapped_huge_bytes`] and [`mapped_huge_bytes_of`]: the bytes of a mapping that PMD entries map,
//! from `smaps` (`ShmemPmdMapped`, `FilePmdMapped`): what the kernel did, not what was asked.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use nix::errno::Errno;

const PMD_SIZE_FILE: &str = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size";
const SMALL_PAGE_BYTES: usize = 4096;

/// The size of a huge page that one PMD entry maps, if this kernel has transparent huge pages.
pub fn pmd_bytes() -> Option<usize> {
    static PMD_BYTES: OnceLock<Option<usize>> = OnceLock::new();
    *PMD_BYTES.get_or_init(|| {
        let text = std::fs::read_to_string(PMD_SIZE_FILE).ok()?;
        text.trim().parse().ok().filter(|bytes: &usize| bytes.is_power_of_two())
    })
}

/// What this machine says about huge pages for shared memory: enough to tell whether
/// `back_with_huge_pages` should get them, for tests and benchmark reports (the creation itself
/// just asks, and takes the kernel's answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// [`pmd_bytes`].
    pub pmd_bytes: Option<usize>,
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`, the selected word (`never`, `deny`..).
    pub shmem_enabled: Option<String>,
    /// Whether this process may have huge pages (`THP_enabled` of `/proc/self/status`).
    pub process_allows: bool,
}

impl Settings {
    pub fn read() -> Settings {
        let shmem_enabled =
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
                .ok()
                .and_then(|text| Some(text.split_once('[')?.1.split_once(']')?.0.to_owned()));
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let process_allows = status
            .lines()
            .find_map(|line| line.strip_prefix("THP_enabled:"))
            .is_some_and(|value| value.trim() == "1");
        Settings { pmd_bytes: pmd_bytes(), shmem_enabled, process_allows }
    }

    /// Whether `MADV_COLLAPSE` should give huge pages here: transparent huge pages built in, not
    /// denied to shared memory, not turned off for this process. (`never` and the `/dev/shm`
    /// mount's `huge=` option do not stop it; a kernel before 6.1 or no free huge page does.)
    pub fn gives_huge_pages(&self) -> bool {
        self.pmd_bytes.is_some()
            && self.shmem_enabled.as_deref().is_some_and(|word| word != "deny")
            && self.process_allows
    }
}

impl std::fmt::Display for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "huge page {} KiB, shmem_enabled {}, huge pages {} for this process",
            self.pmd_bytes.map_or(0, |bytes| bytes / 1024),
            self.shmem_enabled.as_deref().unwrap_or("unreadable"),
            if self.process_allows { "allowed" } else { "turned off" }
        )
    }
}

/// How `back_with_huge_pages` went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HugeBacking {
    /// Bytes of the object now in huge pages.
    pub bytes: usize,
    /// Why not every whole chunk is, if it is not: the kernel's refusal, or `ENOSPC` when the
    /// object does not fit in the file system's free space.
    pub refused: Option<Errno>,
}

/// Backs the whole PMD-sized chunks of a new object with huge pages (module flow).
///
/// `fd` is the object, `map` this process's mapping of all of it, from `Mapping::new`.
pub(crate) fn back_with_huge_pages(fd: BorrowedFd<'_>, map: &Mapping) -> HugeBacking {
    let Some(chunk) = pmd_bytes() else {
        return HugeBacking { bytes: 0, refused: Some(Errno::ENOSYS) };
    };
    let fits = nix::sys::statvfs::fstatvfs(fd).is_ok_and(|stat| {
        let free = u128::from(stat.blocks_available()) * u128::from(stat.fragment_size());
        map.len() as u128 <= free
    });
    if !fits {
        return HugeBacking { bytes: 0, refused: Some(Errno::ENOSPC) };
    }
    let whole_chunks = map.len() / chunk * chunk;
    if whole_chunks == 0 {
        return HugeBacking { bytes: 0, refused: None };
    }
    for head in (0..whole_chunks).step_by(chunk) {
        let offset = libc::off_t::try_from(head).expect("a mapped length fits in off_t");
        if let Err(errno) = nix::fcntl::posix_fallocate(fd, offset, SMALL_PAGE_BYTES as _) {
            return HugeBacking { bytes: 0, refused: Some(errno) };
        }
    }
    // SAFETY: [0, whole_chunks) lies inside the mapping, which lives while `map` is borrowed, and
    // starts on a PMD boundary (Mapping::new). MADV_COLLAPSE keeps the bytes as they are (each
    // backed page is copied into its huge page, the rest is zero as before), and no other process
    // knows the object yet (the caller created it with O_EXCL just now), so nothing races with it.
    let result = unsafe { libc::madvise(map.as_ptr().cast(), whole_chunks, MADV_COLLAPSE) };
    let refused = (result != 0).then(Errno::last);
    // One call for all chunks: the kernel drains every CPU's page lists once per call, not once
    // per chunk. How far it got is what the kernel mapped.
    let bytes = mapped_huge_bytes(map.as_ptr()).unwrap_or(0);
    HugeBacking { bytes: usize::try_from(bytes).expect("within a mapped length"), refused }
}

/// Linux's `MADV_COLLAPSE` (6.1), which the libc crate defines for glibc targets only.
const MADV_COLLAPSE: libc::c_int = 25;

/// Turns huge pages off (`true`) or on again for this process and the processes it starts from now
/// (`prctl(PR_SET_THP_DISABLE)`): what a system without them looks like to kvshm. For benchmarks
/// and tests of the small-page path.
pub fn refuse_in_this_process(refuse: bool) -> Result<(), Errno> {
    // SAFETY: PR_SET_THP_DISABLE takes an integer flag and no pointers; the three unused
    // arguments must be zero.
    let result = unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, libc::c_ulong::from(refuse), 0_u64, 0_u64, 0_u64)
    };
    Errno::result(result).map(drop)
}

/// A shared, read-write mapping of a whole object that starts on a PMD boundary (module flow),
/// unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is an address range and its length; it hands out raw pointers only, and
// unmapping it on drop is valid from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: no method reads or writes the mapped bytes through `&self`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0, read-write and shared, at a PMD-aligned address.
    pub(crate) fn new(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping, Errno> {
        let align = pmd_bytes().unwrap_or(SMALL_PAGE_BYTES);
        let reserved_len = len.checked_add(align).ok_or(Errno::ENOMEM)?;
        // SAFETY: a new anonymous mapping with no access at an address the kernel picks: it
        // overlaps nothing of ours and only reserves address space.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reserved == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        let start = reserved as usize;
        let aligned = start.next_multiple_of(align);
        let mapped_end = aligned + len.next_multiple_of(SMALL_PAGE_BYTES);
        // SAFETY: [aligned, aligned + len) lies inside the reservation made above (aligned <
        // start + align, and len more bytes fit in reserved_len); MAP_FIXED replaces only that
        // part of our own reservation, which nothing else uses.
        let mapped = unsafe {
            libc::mmap(
                aligned as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        let failed = (mapped == libc::MAP_FAILED).then(Errno::last);
        let slack = match failed {
            Some(_) => [(start, reserved_len), (0, 0)],
            None => [(start, aligned - start), (mapped_end, start + reserved_len - mapped_end)],
        };
        for (slack_start, slack_len) in slack.into_iter().filter(|&(_, len)| len > 0) {
            // SAFETY: each range is a page-aligned part of the reservation that the object's
            // mapping does not cover (or all of it after a failure); nothing points into it.
            unsafe { libc::munmap(slack_start as *mut libc::c_void, slack_len) };
        }
        if let Some(errno) = failed {
            return Err(errno);
        }
        let base = NonNull::new(mapped.cast()).expect("a successful mmap is never at null");
        Ok(Mapping { base, len })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping made in `new`, unmapped once, here; the owner of the
        // Mapping promised (SharedMemory's contract) that no pointer into it is used afterwards.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Bytes of this process's mapping that contains `address` mapped by PMD entries (huge pages);
/// `None` if `/proc/self/smaps` cannot be read or lists no such mapping.
pub fn mapped_huge_bytes(address: *const u8) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let address = address as u64;
    pmd_mapped_bytes(&smaps, |start, end, _| (start..end).contains(&address))
}

/// Bytes of process `pid`'s mappings of the file `path` (e.g. `/dev/shm/kvshm.NAME.host.0`)
/// mapped by PMD entries; `None` if its `smaps` cannot be read or lists no mapping of the file.
pub fn mapped_huge_bytes_of(pid: u32, path: &str) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    pmd_mapped_bytes(&smaps, |_, _, mapped_path| mapped_path == path)
}

/// Sum of `ShmemPmdMapped` and `FilePmdMapped` over the mappings in `smaps` that `wanted` picks
/// from their (start, end, path); `None` if it picks none.
fn pmd_mapped_bytes(smaps: &str, wanted: impl Fn(u64, u64, &str) -> bool) -> Option<u64> {
    let mut total = None;
    let mut in_wanted = false;
    for line in smaps.lines() {
        if let Some((start, end, path)) = mapping_header(line) {
            in_wanted = wanted(start, end, path);
            if in_wanted {
                total.get_or_insert(0);
            }
            continue;
        }
        let Some(kib) = line
            .strip_prefix("ShmemPmdMapped:")
            .or_else(|| line.strip_prefix("FilePmdMapped:"))
            .filter(|_| in_wanted)
            .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        else {
            continue;
        };
        total = total.map(|bytes| bytes + kib * 1024);
    }
    total
}

/// (start, end, path) of an `smaps` line that opens a mapping (`start-end perms offset dev inode
/// path`); `None` for the lines of fields within one.
fn mapping_header(line: &str) -> Option<(u64, u64, &str)> {
    let (range, rest) = line.split_once(' ')?;
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let path = rest.split_whitespace().nth(4).unwrap_or("");
    Some((start, end, path))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::shm::{self, SharedMemory};

    fn unique_object(tag: &str) -> String {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        format!("/kvshm-test-huge.{tag}.{}.{count}", std::process::id())
    }

    /// Maps every page of `memory` in (as the worker's pre-fault does).
    fn populate(memory: &SharedMemory) {
        // SAFETY: the range is `memory`'s whole mapping, which lives across the call;
        // MADV_POPULATE_WRITE maps the object's pages without reading or writing a byte.
        let result = unsafe {
            libc::madvise(memory.as_ptr().cast(), memory.len(), libc::MADV_POPULATE_WRITE)
        };
        assert_eq!(result, 0, "populate: {}", Errno::last());
    }

    #[test]
    fn a_new_object_is_in_huge_pages_where_the_kernel_gives_them_and_stays_so_when_opened() {
        let settings = Settings::read();
        let (gives, found) = (settings.gives_huge_pages(), settings.to_string());
        let chunk = pmd_bytes().unwrap_or(2 << 20);
        let object = unique_object("given");
        // Four whole huge pages and a small page beyond them, as an arena's header page adds.
        let len = 4 * chunk + SMALL_PAGE_BYTES;
        let (created, huge) = SharedMemory::create_reporting_huge_pages(&object, len)
            .unwrap_or_else(|error| panic!("creating {object} ({found}): {error}"));
        let opened = SharedMemory::open(&object).unwrap();
        shm::unlink(&object).unwrap();
        assert_eq!(opened.as_ptr() as usize % chunk, 0, "mappings start on a PMD boundary");
        populate(&opened);
        if gives {
            assert_eq!(huge, HugeBacking { bytes: 4 * chunk, refused: None }, "{found}");
            assert_eq!(created.mapped_huge_bytes(), 4 * chunk as u64, "{found}");
            assert_eq!(opened.mapped_huge_bytes(), 4 * chunk as u64, "{found}");
        } else {
            assert_eq!(huge.bytes, 0, "{found}");
            assert!(huge.refused.is_some(), "{found}");
            assert_eq!(opened.mapped_huge_bytes(), 0, "{found}");
        }
        // SAFETY: both mappings are `len` bytes long and live until the end of the test; one
        // thread, and no other process knows the unlinked object; volatile accesses, so that the
        // two addresses of one page are each really read and written.
        unsafe {
            assert_eq!(opened.as_ptr().add(len - 1).read_volatile(), 0);
            created.as_ptr().add(chunk + 5).write_volatile(7);
            assert_eq!(opened.as_ptr().add(chunk + 5).read_volatile(), 7);
        }
    }

    const REFUSING_CHILD: &str = "KVSHM_TEST_HUGE_PAGES_REFUSED";

    /// Runs in a child process (huge pages are turned off per process): the kernel refuses them,
    /// and the object is created all the same, every byte backed by small pages.
    #[test]
    fn a_new_object_falls_back_to_small_pages_where_huge_ones_are_refused() {
        if std::env::var_os(REFUSING_CHILD).is_none() {
            let test = "huge_pages::tests::a_new_object_falls_back_to_small_pages_where_huge_ones_are_refused";
            let output = Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(REFUSING_CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(output.status.success(), "the child failed:\n{stdout}\n{stderr}");
            assert!(stdout.contains("1 passed"), "the child ran no test:\n{stdout}");
            return;
        }
        refuse_in_this_process(true).unwrap();
        let settings = Settings::read();
        assert!(!settings.gives_huge_pages(), "{settings}");
        let chunk = pmd_bytes().unwrap_or(2 << 20);
        let object = unique_object("refused");
        let len = 4 * chunk;
        let (created, huge) = SharedMemory::create_reporting_huge_pages(&object, len).unwrap();
        let opened = SharedMemory::open(&object).unwrap();
        let blocks = std::fs::metadata(format!("/dev/shm{object}")).unwrap().blocks();
        shm::unlink(&object).unwrap();
        assert_eq!(huge.bytes, 0);
        assert!(huge.refused.is_some());
        assert!(blocks as usize * 512 >= len, "every byte backed: {blocks} blocks");
        populate(&opened);
        assert_eq!(opened.mapped_huge_bytes(), 0);
        assert_eq!(created.mapped_huge_bytes(), 0);
    }

    #[test]
    fn pmd_mapped_bytes_sum_the_picked_mappings_only() {
        let smaps = "\
7f0000000000-7f0000400000 rw-s 00000000 00:1a 77 /dev/shm/kvshm.a.host.0
Rss:                4096 kB
ShmemPmdMapped:     4096 kB
FilePmdMapped:         0 kB
7f0000400000-7f0000600000 rw-s 00000000 00:1a 78 /dev/shm/kvshm.a.dev.0
ShmemPmdMapped:     2048 kB
7f0000600000-7f0000601000 rw-p 00000000 00:00 0
ShmemPmdMapped:        0 kB
";
        let of_path = |path: &'static str| pmd_mapped_bytes(smaps, move |_, _, p| p == path);
        assert_eq!(of_path("/dev/shm/kvshm.a.host.0"), Some(4 << 20));
        assert_eq!(of_path("/dev/shm/kvshm.a.dev.0"), Some(2 << 20));
        assert_eq!(of_path("/dev/shm/kvshm.b.host.0"), None);
        let at =
            |address: u64| pmd_mapped_bytes(smaps, |start, end, _| (start..end).contains(&address));
        assert_eq!(at(0x7f00_0060_0800), Some(0));
        assert_eq!(at(0x7f00_0040_0000), Some(2 << 20));
    }
}
