//! [`Mappers`]: which other processes map kvshm objects, as their `/proc/PID/maps` show it. An
//! object a running process maps is in use (an engine copying into a shared tier's arena, a
//! worker into its segment's), whatever its creator's liveness says: it is never removed.
//!
//! One scan ([`Mappers::scan`]) reads every process's maps once. A process whose maps this user
//! cannot read (another user's, unless root) is not seen; nor is a mapping of an object already
//! unlinked (the kernel names it `(deleted)`: no name of ours reaches it any more).

use std::collections::HashMap;

use crate::inspect::SHM_DIR;
use crate::name::OBJECT_PREFIX;

/// The processes other than this one mapping each kvshm object (module documentation).
#[derive(Debug, Default)]
pub struct Mappers {
    by_object: HashMap<String, Vec<u32>>,
}

impl Mappers {
    /// Reads the maps of every process but this one.
    pub fn scan() -> Mappers {
        let mut mappers = Mappers::default();
        let own = std::process::id();
        let Ok(processes) = std::fs::read_dir("/proc") else { return mappers };
        for entry in processes.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != own {
                mappers.add_process(pid, &entry.path().join("maps"));
            }
        }
        mappers
    }

    /// Records the kvshm objects process `pid` maps, from its maps file `maps` (nothing if it
    /// cannot be read). Read as bytes, not text: another mapping's path may hold any bytes.
    fn add_process(&mut self, pid: u32, maps: &std::path::Path) {
        if let Ok(maps) = std::fs::read(maps) {
            self.add(pid, &String::from_utf8_lossy(&maps));
        }
    }

    /// Records the kvshm objects named in `maps` (a `/proc/PID/maps` text) as mapped by `pid`.
    fn add(&mut self, pid: u32, maps: &str) {
        let prefix = format!("{SHM_DIR}/{OBJECT_PREFIX}");
        for line in maps.lines() {
            // `address perms offset device inode path`: the path is what follows the fifth
            // field (it may hold spaces); a mapping of an unlinked object ends in " (deleted)".
            let mut rest = line;
            for _ in 0..5 {
                rest = rest.trim_start();
                rest = rest.find(' ').map_or("", |end| &rest[end..]);
            }
            let path = rest.trim_start();
            if !path.starts_with(prefix.as_str()) || path.contains(' ') {
                continue;
            }
            let object = &path[SHM_DIR.len()..];
            let pids = self.by_object.entry(object.to_owned()).or_default();
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
    }

    /// The processes other than this one that map `object` (a name with its leading slash).
    pub fn of(&self, object: &str) -> &[u32] {
        self.by_object.get(object).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_name_the_objects_mapped_and_not_the_deleted_ones() {
        let mut mappers = Mappers::default();
        let maps = "\
7f00-7f10 rw-s 00000000 00:1a 42 /dev/shm/kvshm.tier-a.host.0
7f10-7f20 rw-s 00000000 00:1a 43 /dev/shm/kvshm.tier-a.host.1 (deleted)
7f20-7f30 rw-s 00001000 00:1a 42 /dev/shm/kvshm.tier-a.host.0
7f30-7f40 r--p 00000000 08:01 7 /usr/lib/libc.so.6
7f40-7f50 rw-p 00000000 00:00 0
";
        mappers.add(12, maps);
        mappers.add(13, "1-2 rw-s 0 00:1a 42 /dev/shm/kvshm.tier-a.host.0\n");
        // Another directory's file of the same tail is not the object.
        mappers.add(14, "1-2 rw-s 0 08:01 9 /tmp/x/dev/shm/kvshm.tier-a.host.0\n");
        assert_eq!(mappers.of("/kvshm.tier-a.host.0"), [12, 13]);
        assert!(mappers.of("/kvshm.tier-a.host.1").is_empty(), "an unlinked object is not ours");
        assert!(mappers.of("/kvshm.other").is_empty());
    }

    /// A process that also maps a file whose name is not UTF-8 is still seen mapping ours.
    #[test]
    fn a_mapping_of_a_file_named_in_other_bytes_hides_nothing() {
        use std::os::unix::ffi::OsStrExt;

        let odd = std::ffi::OsStr::from_bytes(b"/tmp/kvshm-mappers-\xff-odd");
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(odd)
            .unwrap();
        file.set_len(4096).unwrap();
        let length = std::num::NonZeroUsize::new(4096).unwrap();
        // SAFETY: a fresh shared mapping of a file only this test uses, unmapped below; no
        // Rust reference is made into it.
        let odd_map = unsafe {
            nix::sys::mman::mmap(
                None,
                length,
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_SHARED,
                &file,
                0,
            )
        }
        .unwrap();
        let object = format!("/{OBJECT_PREFIX}mappers-odd-{}", std::process::id());
        let memory = crate::shm::SharedMemory::create(&object, 4096).unwrap();

        let mut mappers = Mappers::default();
        mappers.add_process(std::process::id(), std::path::Path::new("/proc/self/maps"));
        let seen = mappers.of(&object).to_vec();
        drop(memory);
        let _ = crate::shm::unlink(&object);
        // SAFETY: the mapping made above, of that length, used by nothing since.
        unsafe { nix::sys::mman::munmap(odd_map, 4096) }.unwrap();
        let _ = std::fs::remove_file(odd);
        assert_eq!(seen, [std::process::id()]);
    }

    /// This process's own mappings are never counted: the scan is of the others.
    #[test]
    fn a_scan_leaves_out_this_process() {
        let object = format!("/{OBJECT_PREFIX}mappers-self-{}", std::process::id());
        let memory = crate::shm::SharedMemory::create(&object, 4096).unwrap();
        assert!(Mappers::scan().of(&object).is_empty());
        drop(memory);
        let _ = crate::shm::unlink(&object);
    }
}
