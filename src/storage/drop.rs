//! Dropping a storage namespace: every block every service stored under one namespace, on disk
//! or in Redis (`kvctl reset-storage`).
//!
//! Core types: [`DroppedNamespace`] (what went) and [`DropError`].
//!
//! Flow ([`drop_namespace`]):
//! - disk: 0. a `DIR` that is not there is refused as mistyped (a namespace nothing was stored
//!   under drops nothing); 1. list `DIR/NAMESPACE/rank-R.index`; 2. take each index's lock without waiting (a
//!   worker serving the namespace holds it: the drop is refused, naming the file, and nothing is
//!   removed); 3. holding every lock, remove every rank's slab and index, then the directory;
//! - Redis: `SCAN MATCH kvshm:NAMESPACE:*` and `UNLINK` what it returns, batch by batch. Services
//!   running meanwhile lose those blocks (their loads miss, counted), nothing else.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use super::direct_io::lock_exclusive;
use super::disk_index::names_file;
use super::spec::{redact, StorageNamespace, StorageSpec};

/// Keys asked for per `SCAN` call.
const SCAN_COUNT: usize = 1000;

/// What a drop removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DroppedNamespace {
    pub storage: String,
    pub namespace: String,
    /// Disk: slab and index files removed, and their bytes.
    pub files: usize,
    pub bytes: u64,
    /// Redis: keys removed.
    pub keys: u64,
}

/// Why a namespace could not be dropped.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error("{path}: a worker serves this namespace (it holds the index's lock); stop the service first")]
    InUse { path: PathBuf },
    #[error("{path}: no such storage directory (a disk tier's directory, as its workers' --storage disk:DIR names it)")]
    NoDirectory { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("redis {url}: {source}")]
    Redis { url: String, source: redis::RedisError },
}

/// Drops every block stored under `namespace` in `storage` (module flow).
pub fn drop_namespace(
    storage: &StorageSpec,
    namespace: &StorageNamespace,
    timeout: Duration,
) -> Result<DroppedNamespace, DropError> {
    let mut dropped = DroppedNamespace {
        storage: storage.to_string(),
        namespace: namespace.as_str().to_owned(),
        ..DroppedNamespace::default()
    };
    match storage {
        StorageSpec::Disk { dir } => {
            // A directory that is not there is a mistyped one, not an empty tier.
            if !dir.is_dir() {
                return Err(DropError::NoDirectory { path: dir.clone() });
            }
            drop_disk(&dir.join(namespace.as_str()), &mut dropped)?;
        }
        StorageSpec::Redis { url } => {
            dropped.keys = drop_redis(url, namespace.as_str(), timeout)
                .map_err(|source| DropError::Redis { url: redact(url), source })?;
        }
    }
    Ok(dropped)
}

fn drop_disk(dir: &Path, dropped: &mut DroppedNamespace) -> Result<(), DropError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| DropError::Io { path, source }
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(io(dir)(error)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        let ours =
            name.starts_with("rank-") && (name.ends_with(".index") || name.ends_with(".slab"));
        if ours {
            files.push(path);
        }
    }
    // Slabs before indexes: a worker that opens a rank once its index is gone makes a new pair
    // (`IndexFile::open` takes the lock of the file the path names), and must not find the old
    // slab still there.
    files.sort_by_key(|path| (path.extension().is_some_and(|ext| ext == "index"), path.clone()));
    // Every index locked before anything is removed: all or nothing.
    let mut locks = Vec::new();
    for path in files.iter().filter(|path| path.extension().is_some_and(|ext| ext == "index")) {
        let file = File::open(path).map_err(io(path))?;
        // Another reset may have removed the file while this waited for its lock, and a worker
        // made a new one under the name: that one is in use.
        if !lock_exclusive(&file).map_err(io(path))?
            || !names_file(path, &file).map_err(io(path))?
        {
            return Err(DropError::InUse { path: path.clone() });
        }
        locks.push(file);
    }
    for path in &files {
        let bytes = std::fs::metadata(path).map_err(io(path))?.len();
        std::fs::remove_file(path).map_err(io(path))?;
        dropped.files += 1;
        dropped.bytes += bytes;
    }
    drop(locks);
    // Only an empty directory goes (something else of the operator's stays).
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

fn drop_redis(url: &str, namespace: &str, timeout: Duration) -> Result<u64, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_connection_with_timeout(timeout)?;
    connection.set_read_timeout(Some(timeout))?;
    connection.set_write_timeout(Some(timeout))?;
    let pattern = format!("kvshm:{namespace}:*");
    let mut cursor: u64 = 0;
    let mut removed = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query(&mut connection)?;
        if !keys.is_empty() {
            removed += redis::cmd("UNLINK").arg(&keys).query::<u64>(&mut connection)?;
        }
        if next == 0 {
            return Ok(removed);
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvshm-drop-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("ns")).unwrap();
        dir
    }

    #[test]
    fn a_disk_namespace_goes_whole_and_a_locked_one_is_refused_untouched() {
        let dir = scratch("disk");
        for name in ["rank-0.index", "rank-0.slab", "rank-1.index", "rank-1.slab", "notes.txt"] {
            std::fs::write(dir.join("ns").join(name), b"12345678").unwrap();
        }
        let spec = StorageSpec::Disk { dir: dir.clone() };
        let namespace = StorageNamespace::new("ns").unwrap();
        let held = File::open(dir.join("ns/rank-1.index")).unwrap();
        assert!(lock_exclusive(&held).unwrap());
        let refused = drop_namespace(&spec, &namespace, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(refused, DropError::InUse { .. }), "{refused}");
        assert!(dir.join("ns/rank-0.slab").exists(), "nothing removed while one rank is in use");
        drop(held);
        let dropped = drop_namespace(&spec, &namespace, Duration::from_secs(1)).unwrap();
        assert_eq!((dropped.files, dropped.bytes), (4, 32));
        assert!(dir.join("ns/notes.txt").exists(), "only the tier's files go");
        let again = drop_namespace(&spec, &StorageNamespace::new("other").unwrap(), Duration::ZERO);
        assert_eq!(again.unwrap().files, 0, "a namespace never used drops nothing");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
