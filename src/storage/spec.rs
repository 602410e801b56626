//! What the user writes to get a storage tier, and opening the back-end it names.
//!
//! Core types: [`StorageSpec`] (`disk:DIR` or `redis://…`), [`StorageNamespace`],
//! [`StorageOptions`] (everything `kvshm worker --storage …` is given) and [`OpenError`].
//!
//! Flow: 1. [`StorageSpec::from_str`] and [`StorageNamespace::new`] check the text; 2. the worker
//! derives the rank's [`BlockLayout`] from its segment; 3. [`StorageOptions::open`] opens the disk
//! slab (creating or reopening it) or sets up the Redis pool (connecting lazily).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::backend::{BlockLayout, StorageBackend};
use super::disk::{CrashHook, DiskBackend, DiskError, DiskOptions};
use super::redis::{RedisBackend, RedisOpenError, RedisOptions};

/// The environment variable `kvshm worker` and `kvshm tier-owner` read their storage tier from
/// when given `--storage-from-env` ([`spec_given`]): the processes that start them pass it there,
/// since a process's command line is readable by every user of the machine and a Redis URL may
/// carry a password.
pub const STORAGE_ENV: &str = "KVSHM_STORAGE";

/// `--storage-from-env` without a storage spec in [`STORAGE_ENV`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--storage-from-env: {STORAGE_ENV} holds no storage spec (it is unset or empty)")]
pub struct NoSpecInEnv;

/// The storage spec a process was given: `--storage SPEC` (`flag`), or, with
/// `--storage-from-env` (`from_env`), the value of [`STORAGE_ENV`]. The variable alone gives
/// nothing: one inherited from a shell does not give a tier to every worker started from it,
/// only a launcher that passes the flag means it.
pub fn spec_given(flag: Option<&str>, from_env: bool) -> Result<Option<String>, NoSpecInEnv> {
    if !from_env {
        return Ok(flag.map(str::to_owned));
    }
    match std::env::var(STORAGE_ENV) {
        Ok(spec) if !spec.is_empty() => Ok(Some(spec)),
        _ => Err(NoSpecInEnv),
    }
}

/// Where the storage tier lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageSpec {
    /// A slab per rank in this directory (created if missing).
    Disk { dir: PathBuf },
    /// A Redis server: the URL as given (`redis://…`, `redis+unix://…`, `unix://…`).
    Redis { url: String },
}

/// A storage spec that is neither `disk:DIR` nor a Redis URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "storage {text:?} is neither disk:DIR nor redis://HOST[:PORT][/DB] (or redis+unix:///PATH)"
)]
pub struct ParseSpecError {
    pub text: String,
}

impl FromStr for StorageSpec {
    type Err = ParseSpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        // The text may be a URL of another scheme with a password in it.
        let error = || ParseSpecError { text: redact(text) };
        if let Some(dir) = text.strip_prefix("disk:") {
            if dir.is_empty() {
                return Err(error());
            }
            return Ok(StorageSpec::Disk { dir: PathBuf::from(dir) });
        }
        if ["redis://", "redis+unix://", "unix://"].iter().any(|scheme| text.starts_with(scheme)) {
            return Ok(StorageSpec::Redis { url: text.to_owned() });
        }
        Err(error())
    }
}

impl std::fmt::Display for StorageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorageSpec::Disk { dir } => write!(f, "disk:{}", dir.display()),
            StorageSpec::Redis { url } => f.write_str(&redact(url)),
        }
    }
}

/// A URL with any password replaced by `***` (for logs and reports): the password of the
/// user information (before the authority's last `@`, as URLs are parsed; all of it when it
/// names no user apart), and the value of a `pass` or `password` query parameter (a Unix
/// socket's). Text that is no URL comes back as it is.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let (before_query, query) = match rest.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (rest, None),
    };
    let authority_end = before_query.find(['/', '#']).unwrap_or(before_query.len());
    let (authority, path) = before_query.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((credentials, host)) => match credentials.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("***@{host}"),
        },
        None => authority.to_owned(),
    };
    let mut redacted = format!("{scheme}://{authority}{path}");
    if let Some(query) = query {
        let parameters: Vec<String> = query
            .split('&')
            .map(|parameter| match parameter.split_once('=') {
                Some((name, _)) if matches!(name, "pass" | "password") => format!("{name}=***"),
                _ => parameter.to_owned(),
            })
            .collect();
        redacted.push('?');
        redacted.push_str(&parameters.join("&"));
    }
    redacted
}

/// The name under which a service's blocks are kept: a directory under the disk tier's
/// directory, a key prefix in Redis. Services that should share blocks use the same namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StorageNamespace(String);

/// The namespace used when none is given.
pub const DEFAULT_NAMESPACE: &str = "default";

/// A namespace that is not 1 to 64 of `[A-Za-z0-9_.-]` (or is `.` or `..`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("storage namespace {text:?} is not 1 to 64 of [A-Za-z0-9_.-] (and not . or ..)")]
pub struct BadNamespace {
    pub text: String,
}

impl StorageNamespace {
    pub fn new(text: &str) -> Result<StorageNamespace, BadNamespace> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
        if (1..=64).contains(&text.len())
            && text.chars().all(allowed)
            && text != "."
            && text != ".."
        {
            Ok(StorageNamespace(text.to_owned()))
        } else {
            Err(BadNamespace { text: text.to_owned() })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for StorageNamespace {
    fn default() -> Self {
        StorageNamespace(DEFAULT_NAMESPACE.to_owned())
    }
}

/// Everything a worker needs to open its rank's storage back-end.
#[derive(Clone, Debug)]
pub struct StorageOptions {
    pub spec: StorageSpec,
    pub namespace: StorageNamespace,
    /// Disk: slots per rank; `None`: [`DEFAULT_CAPACITY_PER_HOST_BLOCK`] x host blocks (an
    /// existing slab is resized to it).
    pub capacity_blocks: Option<u64>,
    /// Disk: try O_DIRECT (default true).
    pub prefer_direct: bool,
    /// Redis: expiry of blocks, refreshed by reads.
    pub ttl: Option<Duration>,
    /// Redis: connections per worker.
    pub connections: usize,
    /// Redis: the longest wait for one answer (a timeout is a counted miss).
    pub io_timeout: Duration,
    /// Redis: the longest wait for a connection.
    pub connect_timeout: Duration,
    /// Disk test hook (see [`CrashHook`]).
    pub crash: Option<CrashHook>,
}

/// Disk capacity per host block when none is given: the storage tier holds this many times the
/// host tier.
pub const DEFAULT_CAPACITY_PER_HOST_BLOCK: u64 = 4;
pub const DEFAULT_CONNECTIONS: usize = 4;
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

impl StorageOptions {
    /// Options with the defaults for everything but the spec.
    pub fn new(spec: StorageSpec) -> StorageOptions {
        StorageOptions {
            spec,
            namespace: StorageNamespace::default(),
            capacity_blocks: None,
            prefer_direct: true,
            ttl: None,
            connections: DEFAULT_CONNECTIONS,
            io_timeout: DEFAULT_IO_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            crash: None,
        }
    }

    /// Opens the back-end of `rank` for blocks of `layout`; `host_blocks` sizes a default disk
    /// capacity.
    pub fn open(
        &self,
        rank: u32,
        layout: BlockLayout,
        host_blocks: u32,
    ) -> Result<Box<dyn StorageBackend>, OpenError> {
        match &self.spec {
            StorageSpec::Disk { dir } => {
                let capacity_blocks = self
                    .capacity_blocks
                    .unwrap_or((u64::from(host_blocks) * DEFAULT_CAPACITY_PER_HOST_BLOCK).max(1));
                let backend = DiskBackend::open(&DiskOptions {
                    dir: dir.clone(),
                    namespace: self.namespace.as_str().to_owned(),
                    rank,
                    layout,
                    capacity_blocks,
                    prefer_direct: self.prefer_direct,
                    crash: self.crash,
                })?;
                Ok(Box::new(backend))
            }
            StorageSpec::Redis { url } => {
                let backend = RedisBackend::open(&RedisOptions {
                    url: url.clone(),
                    namespace: self.namespace.as_str().to_owned(),
                    rank,
                    layout,
                    ttl: self.ttl,
                    connections: self.connections,
                    io_timeout: self.io_timeout,
                    connect_timeout: self.connect_timeout,
                })?;
                Ok(Box::new(backend))
            }
        }
    }
}

/// Why a storage back-end cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("disk storage: {0}")]
    Disk(#[from] DiskError),
    #[error("redis storage: {0}")]
    Redis(#[from] RedisOpenError),
}

impl OpenError {
    /// Whether another process holds the slab (a worker being replaced): worth retrying.
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            OpenError::Disk(DiskError::Index(super::disk_index::IndexError::Busy { .. }))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_a_directory_or_a_redis_url() {
        assert_eq!(
            "disk:/var/cache/kv".parse(),
            Ok(StorageSpec::Disk { dir: "/var/cache/kv".into() })
        );
        assert_eq!(
            "redis://10.0.0.1:6380/2".parse(),
            Ok(StorageSpec::Redis { url: "redis://10.0.0.1:6380/2".into() })
        );
        assert!("redis+unix:///run/redis.sock".parse::<StorageSpec>().is_ok());
        for bad in ["disk:", "/var/cache", "http://x", "rediss://x", ""] {
            assert!(bad.parse::<StorageSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn passwords_never_reach_the_display() {
        let spec: StorageSpec = "redis://app:s3cret@cache:6379/0".parse().unwrap();
        assert_eq!(spec.to_string(), "redis://app:***@cache:6379/0");
        assert_eq!(redact("redis://cache:6379"), "redis://cache:6379");
        // The authority's last `@` ends the user information, as URL parsers have it.
        assert_eq!(redact("redis://app:p@ss@cache:6379/0"), "redis://app:***@cache:6379/0");
        assert_eq!(redact("redis://s3cret@cache"), "redis://***@cache");
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=2&pass=s3cret&user=app"),
            "redis+unix:///run/redis.sock?db=2&pass=***&user=app"
        );
        // A spec refused for its scheme does not echo its password either.
        let refused = "rediss://app:s3cret@cache:6380".parse::<StorageSpec>().unwrap_err();
        assert!(!refused.to_string().contains("s3cret"), "{refused}");
    }

    #[test]
    fn namespaces_are_short_plain_names() {
        assert!(StorageNamespace::new("prod-llama3.1_70b").is_ok());
        for bad in ["", ".", "..", "a/b", "a:b", "é", &"x".repeat(65)] {
            assert!(StorageNamespace::new(bad).is_err(), "{bad}");
        }
        assert_eq!(StorageNamespace::default().as_str(), "default");
    }
}
