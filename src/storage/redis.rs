//! The Redis back-end: blocks shared across services and machines through a Redis (or Valkey)
//! server, with the `redis` crate's blocking client.
//!
//! Core types: [`RedisBackend`], [`RedisOptions`], [`RedisOpenError`].
//!
//! Keys: `kvshm:<namespace>:<layout>:<hash>:<rank>`, e.g.
//! `kvshm:default:tp2-r64x16384:0123…cdef:1`: the namespace the operator chose, the layout tag
//! (TP size, regions x region bytes: services whose ranks hold different bytes never overwrite
//! each other), the 32 hex digits of the block hash, and the rank. Values: an 80-byte header
//! (magic, layout, hash, parent, depth, checksum; see [`super::format`]) and the block's bytes.
//! Two services with different segments but the same namespace and layout share every block.
//!
//! Connections: a pool of `connections` blocking connections per worker, opened lazily. A batch
//! is split into as many parts as there are connections, and each part goes out as one pipeline
//! on its own connection from its own thread:
//!
//! 1. put: `SET key value [EX ttl]` per block, pipelined; a server error for one block (e.g.
//!    `OOM`: maxmemory reached with the noeviction policy) fails that block only;
//! 2. get: one `MGET` of the part's keys (with a TTL: pipelined `GETEX key EX ttl`, so a block
//!    read stays alive), each value checked ([`super::format::check_value`]) and copied into its
//!    destination;
//! 3. contains: pipelined `EXISTS`; remove: one `UNLINK`.
//!
//! Failures: a connection that errs (timeout, reset, refused) is dropped and its part's blocks
//! fail ([`Failure::Timeout`] or [`Failure::Unavailable`]); the next call reconnects. A pooled
//! connection that breaks (closed while idle by the server's `timeout`, a proxy, a restart;
//! not a timeout) is the exception: the part goes once more at once, on a fresh connection. A
//! connect that fails starts a back-off (50 ms doubling to 1 s) during which that connection's
//! parts fail at once as `Unavailable` instead of waiting: while Redis is away every block is a
//! quick, counted miss, and once it is back the first call after the back-off reconnects.

use std::time::{Duration, Instant};

use redis::{Connection, RedisError, Value};

use super::backend::{
    check_len, BackendStats, BlockLayout, ContainsOutcome, Failure, GetBlock, GetMiss, GetOutcome,
    PutBlock, PutOutcome, StorageBackend,
};
use super::format::{check_value, encode_value};
use super::spec::redact;
use crate::hash::BlockHash;

/// The first pause after a failed connect.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause between connect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// What a Redis back-end is opened with.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://[user:password@]host[:port][/db]` or `redis+unix:///path`.
    pub url: String,
    /// A validated storage namespace.
    pub namespace: String,
    pub rank: u32,
    pub layout: BlockLayout,
    /// Expiry of stored blocks (whole seconds, at least 1), refreshed by every read; `None`:
    /// kept until Redis evicts them (its maxmemory policy).
    pub ttl: Option<Duration>,
    /// Connections of the pool (at least 1).
    pub connections: usize,
    /// The longest wait for one pipeline's answer.
    pub io_timeout: Duration,
    /// The longest wait for a connection.
    pub connect_timeout: Duration,
}

/// Why a Redis back-end cannot be set up (an unreachable server is not one: it is a miss).
#[derive(Debug, thiserror::Error)]
pub enum RedisOpenError {
    /// `url` has its password masked.
    #[error("redis url {url:?}: {source}")]
    BadUrl { url: String, source: RedisError },
    #[error("a redis pool needs at least one connection")]
    NoConnections,
    #[error("redis ttl must be a whole number of seconds, at least 1 (got {ttl:?})")]
    BadTtl { ttl: Duration },
    #[error("redis timeouts must be non-zero")]
    ZeroTimeout,
}

/// One connection of the pool.
struct Pooled {
    connection: Option<Connection>,
    /// No connect attempt before this instant (back-off after a failed connect).
    retry_at: Option<Instant>,
    backoff: Duration,
    connects: u64,
}

/// The Redis back-end of one rank (module documentation).
pub struct RedisBackend {
    client: redis::Client,
    pool: Vec<Pooled>,
    prefix: String,
    rank: u32,
    layout: BlockLayout,
    ttl_seconds: Option<u64>,
    io_timeout: Duration,
    connect_timeout: Duration,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.prefix)
            .field("rank", &self.rank)
            .field("connections", &self.pool.len())
            .finish()
    }
}

/// The key prefix of a namespace and layout: `kvshm:<namespace>:<layout>:`.
pub fn key_prefix(namespace: &str, layout: &BlockLayout) -> String {
    format!("kvshm:{namespace}:{}:", layout.key_tag())
}

/// The key of block `hash` of `rank`.
pub fn block_key(prefix: &str, hash: BlockHash, rank: u32) -> String {
    format!("{prefix}{hash}:{rank}")
}

impl RedisBackend {
    /// Checks the options and parses the URL; connects lazily (module documentation).
    pub fn open(options: &RedisOptions) -> Result<RedisBackend, RedisOpenError> {
        if options.connections == 0 {
            return Err(RedisOpenError::NoConnections);
        }
        if options.io_timeout.is_zero() || options.connect_timeout.is_zero() {
            return Err(RedisOpenError::ZeroTimeout);
        }
        let ttl_seconds = match options.ttl {
            None => None,
            Some(ttl) if ttl.subsec_nanos() == 0 && ttl.as_secs() >= 1 => Some(ttl.as_secs()),
            Some(ttl) => return Err(RedisOpenError::BadTtl { ttl }),
        };
        let client = redis::Client::open(options.url.as_str())
            .map_err(|source| RedisOpenError::BadUrl { url: redact(&options.url), source })?;
        let pool = (0..options.connections)
            .map(|_| Pooled {
                connection: None,
                retry_at: None,
                backoff: FIRST_BACKOFF,
                connects: 0,
            })
            .collect();
        Ok(RedisBackend {
            client,
            pool,
            prefix: key_prefix(&options.namespace, &options.layout),
            rank: options.rank,
            layout: options.layout,
            ttl_seconds,
            io_timeout: options.io_timeout,
            connect_timeout: options.connect_timeout,
        })
    }

    /// Whether every connection of the pool is up (tests and the benchmark wait for it).
    pub fn connect_all(&mut self) -> Result<(), Failure> {
        let link = Link {
            client: &self.client,
            io_timeout: self.io_timeout,
            connect_timeout: self.connect_timeout,
        };
        for pooled in &mut self.pool {
            pooled.retry_at = None;
            link.run(pooled, |_| Ok(()))?;
        }
        Ok(())
    }

    fn key(&self, hash: BlockHash) -> String {
        block_key(&self.prefix, hash, self.rank)
    }

    /// Splits `0..len` into one range per connection in use and runs `part` for each on its own
    /// connection, on its own thread when there are several.
    fn for_parts<R: Send>(
        &mut self,
        len: usize,
        part: impl Fn(&Link<'_>, &mut Pooled, std::ops::Range<usize>) -> R + Sync,
    ) -> Vec<(std::ops::Range<usize>, R)> {
        if len == 0 {
            return Vec::new();
        }
        let parts = self.pool.len().min(len);
        let size = len.div_ceil(parts);
        let ranges: Vec<std::ops::Range<usize>> =
            (0..len).step_by(size).map(|start| start..(start + size).min(len)).collect();
        let link = Link {
            client: &self.client,
            io_timeout: self.io_timeout,
            connect_timeout: self.connect_timeout,
        };
        if ranges.len() == 1 {
            let range = ranges[0].clone();
            let result = part(&link, &mut self.pool[0], range.clone());
            return vec![(range, result)];
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = ranges
                .into_iter()
                .zip(self.pool.iter_mut())
                .map(|(range, pooled)| {
                    let (link, part) = (&link, &part);
                    scope.spawn(move || {
                        let result = part(link, pooled, range.clone());
                        (range, result)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a redis part does not panic")).collect()
        })
    }
}

/// What a part needs to (re)connect.
struct Link<'a> {
    client: &'a redis::Client,
    io_timeout: Duration,
    connect_timeout: Duration,
}

impl Link<'_> {
    /// Runs `request` on `pooled`'s connection, connecting first if needed (module
    /// documentation); any error drops the connection. A connection that sat in the pool may
    /// have been closed meanwhile (the server's idle `timeout`, a proxy, a restart): a request
    /// on a pooled connection that breaks (`Unavailable`: an I/O error or a dropped connection,
    /// not a timeout) goes once more on a fresh one; one that breaks its connection itself pays
    /// twice. Every request is idempotent (SET, MGET, GETEX, EXISTS, UNLINK), so one that got
    /// halfway through changes nothing by being sent again.
    fn run<T>(
        &self,
        pooled: &mut Pooled,
        mut request: impl FnMut(&mut Connection) -> Result<T, RedisError>,
    ) -> Result<T, Failure> {
        let pooled_before = pooled.connection.is_some();
        match self.run_once(pooled, &mut request) {
            Err(Failure::Unavailable) if pooled_before => self.run_once(pooled, &mut request),
            result => result,
        }
    }

    /// One try of [`Link::run`].
    fn run_once<T>(
        &self,
        pooled: &mut Pooled,
        request: &mut impl FnMut(&mut Connection) -> Result<T, RedisError>,
    ) -> Result<T, Failure> {
        if pooled.connection.is_none() {
            if pooled.retry_at.is_some_and(|at| Instant::now() < at) {
                return Err(Failure::Unavailable);
            }
            match self.connect() {
                Ok(connection) => {
                    pooled.connection = Some(connection);
                    pooled.retry_at = None;
                    pooled.backoff = FIRST_BACKOFF;
                    pooled.connects += 1;
                }
                Err(error) => {
                    pooled.retry_at = Some(Instant::now() + pooled.backoff);
                    pooled.backoff = (pooled.backoff * 2).min(MAX_BACKOFF);
                    tracing::debug!(%error, "cannot connect to redis");
                    return Err(match classify(&error) {
                        Failure::Timeout => Failure::Unavailable,
                        failure => failure,
                    });
                }
            }
        }
        let connection = pooled.connection.as_mut().expect("connected above");
        match request(connection) {
            Ok(value) => Ok(value),
            Err(error) => {
                tracing::debug!(%error, "redis request failed; dropping the connection");
                pooled.connection = None;
                Err(classify(&error))
            }
        }
    }

    fn connect(&self) -> Result<Connection, RedisError> {
        let connection = self.client.get_connection_with_timeout(self.connect_timeout)?;
        connection.set_read_timeout(Some(self.io_timeout))?;
        connection.set_write_timeout(Some(self.io_timeout))?;
        Ok(connection)
    }
}

/// The per-block failure a client error stands for.
fn classify(error: &RedisError) -> Failure {
    if error.is_timeout() {
        Failure::Timeout
    } else if error.is_connection_refusal() || error.is_connection_dropped() || error.is_io_error()
    {
        Failure::Unavailable
    } else if error.code() == Some("OOM") {
        Failure::NoSpace
    } else {
        Failure::Io(error.to_string())
    }
}

/// The failure of one command of a pipeline that the server refused.
fn server_failure(value: &Value) -> Option<Failure> {
    match value {
        Value::ServerError(error) if error.code() == "OOM" => Some(Failure::NoSpace),
        Value::ServerError(error) => Some(Failure::Io(format!("redis: {error:?}"))),
        _ => None,
    }
}

/// A reply that is not what the command answers: the server's refusal, or an I/O error.
fn unexpected(value: &Value) -> Failure {
    server_failure(value)
        .unwrap_or_else(|| Failure::Io(format!("unexpected redis reply {value:?}")))
}

/// The replies of one part, one per block, or the failure of the whole part (including a reply
/// count that does not match).
fn replies(blocks: usize, result: Result<Vec<Value>, Failure>) -> Result<Vec<Value>, Failure> {
    match result {
        Ok(values) if values.len() == blocks => Ok(values),
        Ok(values) => Err(Failure::Io(format!("{} replies for {blocks} blocks", values.len()))),
        Err(failure) => Err(failure),
    }
}

/// Fills `outcomes[range]` with `failure`.
fn fail_all<T>(outcomes: &mut [Result<T, Failure>], failure: Failure) {
    for outcome in outcomes {
        *outcome = Err(failure.clone());
    }
}

impl StorageBackend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn layout(&self) -> BlockLayout {
        self.layout
    }

    fn put(&mut self, blocks: &[PutBlock<'_>], outcomes: &mut Vec<PutOutcome>) {
        outcomes.clear();
        outcomes.extend(blocks.iter().map(|block| check_len(block.bytes.len(), &self.layout)));
        let valid: Vec<usize> = (0..blocks.len()).filter(|&i| outcomes[i].is_ok()).collect();
        let (rank, layout, ttl) = (self.rank, self.layout, self.ttl_seconds);
        let keys: Vec<String> = valid.iter().map(|&i| self.key(blocks[i].key.hash)).collect();
        let parts = self.for_parts(valid.len(), |link, pooled, range| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            // One value at a time: `arg` copies it into the pipeline's buffer.
            let mut value = Vec::new();
            for index in range.clone() {
                let block = &blocks[valid[index]];
                encode_value(&block.key, rank, &layout, block.bytes, &mut value);
                let set = pipe.cmd("SET").arg(&keys[index]).arg(value.as_slice());
                if let Some(seconds) = ttl {
                    set.arg("EX").arg(seconds);
                }
            }
            link.run(pooled, |connection| pipe.query::<Vec<Value>>(connection))
        });
        for (range, result) in parts {
            match replies(range.len(), result) {
                Ok(values) => {
                    for (index, value) in range.zip(values) {
                        if let Some(failure) = server_failure(&value) {
                            outcomes[valid[index]] = Err(failure);
                        }
                    }
                }
                Err(failure) => {
                    for index in range {
                        outcomes[valid[index]] = Err(failure.clone());
                    }
                }
            }
        }
    }

    fn get(&mut self, blocks: &mut [GetBlock<'_>], outcomes: &mut Vec<GetOutcome>) {
        outcomes.clear();
        outcomes.extend(
            blocks
                .iter()
                .map(|block| check_len(block.dest.len(), &self.layout).map_err(GetMiss::Failed)),
        );
        let valid: Vec<usize> = (0..blocks.len()).filter(|&i| outcomes[i].is_ok()).collect();
        let keys: Vec<String> = valid.iter().map(|&i| self.key(blocks[i].hash)).collect();
        let ttl = self.ttl_seconds;
        let parts = self.for_parts(valid.len(), |link, pooled, range| {
            let keys = &keys[range];
            link.run(pooled, |connection| match ttl {
                None => redis::cmd("MGET").arg(keys).query::<Vec<Value>>(connection),
                Some(seconds) => {
                    // The reads, then each key's time to live renewed, in one pipeline (`GETEX`
                    // would do both, from Redis 6.2 on; `EXPIRE` is in every Redis).
                    let mut pipe = redis::pipe();
                    pipe.cmd("MGET").arg(keys);
                    for key in keys {
                        pipe.cmd("EXPIRE").arg(key).arg(seconds).ignore();
                    }
                    pipe.query::<(Vec<Value>,)>(connection).map(|(values,)| values)
                }
            })
        });
        let (rank, layout) = (self.rank, self.layout);
        for (range, result) in parts {
            let values = match replies(range.len(), result) {
                Ok(values) => values,
                Err(failure) => {
                    for index in range {
                        outcomes[valid[index]] = Err(GetMiss::Failed(failure.clone()));
                    }
                    continue;
                }
            };
            for (index, value) in range.zip(values) {
                let entry = valid[index];
                let block = &mut blocks[entry];
                outcomes[entry] = match value {
                    Value::Nil => Err(GetMiss::Absent),
                    Value::BulkString(bytes) => {
                        match check_value(&bytes, block.hash, rank, &layout) {
                            Ok(payload) => {
                                block.dest.copy_from(payload);
                                Ok(())
                            }
                            Err(corrupt) => {
                                tracing::debug!(block = %block.hash, %corrupt, "corrupt redis value");
                                Err(GetMiss::Corrupt)
                            }
                        }
                    }
                    other => Err(GetMiss::Failed(unexpected(&other))),
                };
            }
        }
    }

    fn contains(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<ContainsOutcome>) {
        outcomes.clear();
        outcomes.resize(hashes.len(), Ok(false));
        let keys: Vec<String> = hashes.iter().map(|&hash| self.key(hash)).collect();
        let parts = self.for_parts(hashes.len(), |link, pooled, range| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for key in &keys[range] {
                pipe.cmd("EXISTS").arg(key);
            }
            link.run(pooled, |connection| pipe.query::<Vec<Value>>(connection))
        });
        for (range, result) in parts {
            match replies(range.len(), result) {
                Ok(values) => {
                    for (index, value) in range.zip(values) {
                        outcomes[index] = match value {
                            Value::Int(count) => Ok(count > 0),
                            other => Err(unexpected(&other)),
                        };
                    }
                }
                Err(failure) => fail_all(&mut outcomes[range], failure),
            }
        }
    }

    fn remove(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        outcomes.clear();
        outcomes.resize(hashes.len(), Ok(()));
        let keys: Vec<String> = hashes.iter().map(|&hash| self.key(hash)).collect();
        let parts = self.for_parts(hashes.len(), |link, pooled, range| {
            let keys = &keys[range];
            link.run(pooled, |connection| redis::cmd("UNLINK").arg(keys).query::<i64>(connection))
        });
        for (range, result) in parts {
            if let Err(failure) = result {
                fail_all(&mut outcomes[range], failure);
            }
        }
    }

    /// Keeps the values: the namespace is shared, and another service pointed at this server
    /// may count the blocks this one dropped (TTL and Redis's `maxmemory` policy govern them).
    fn forget(&mut self, hashes: &[BlockHash], outcomes: &mut Vec<PutOutcome>) {
        outcomes.clear();
        outcomes.resize(hashes.len(), Ok(()));
    }

    fn sync(&mut self) -> Result<(), Failure> {
        Ok(())
    }

    fn stats(&self) -> BackendStats {
        BackendStats {
            connects: self.pool.iter().map(|p| p.connects).sum(),
            ..BackendStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_namespace_layout_hash_and_rank() {
        let layout = BlockLayout::new(2 * 4096, 2, 4).unwrap();
        let prefix = key_prefix("prod", &layout);
        assert_eq!(
            block_key(&prefix, BlockHash(0xabc), 3),
            "kvshm:prod:tp4-r2x4096:00000000000000000000000000000abc:3"
        );
    }

    #[test]
    fn bad_options_are_refused_before_connecting() {
        let options = RedisOptions {
            url: "redis://127.0.0.1:1".into(),
            namespace: "t".into(),
            rank: 0,
            layout: BlockLayout::new(4096, 1, 1).unwrap(),
            ttl: None,
            connections: 1,
            io_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        };
        assert!(matches!(
            RedisBackend::open(&RedisOptions { url: "http://x".into(), ..options.clone() }),
            Err(RedisOpenError::BadUrl { .. })
        ));
        let secret =
            RedisOptions { url: "redis://app:s3cret@host:notaport".into(), ..options.clone() };
        let refused = RedisBackend::open(&secret).unwrap_err().to_string();
        assert!(refused.contains("app:***@") && !refused.contains("s3cret"), "{refused}");
        assert!(matches!(
            RedisBackend::open(&RedisOptions { connections: 0, ..options.clone() }),
            Err(RedisOpenError::NoConnections)
        ));
        assert!(matches!(
            RedisBackend::open(&RedisOptions {
                ttl: Some(Duration::from_millis(1500)),
                ..options.clone()
            }),
            Err(RedisOpenError::BadTtl { .. })
        ));
    }

    #[test]
    fn an_unreachable_server_is_a_quick_counted_miss_not_an_error() {
        // Port 1 on loopback refuses at once.
        let options = RedisOptions {
            url: "redis://127.0.0.1:1".into(),
            namespace: "t".into(),
            rank: 0,
            layout: BlockLayout::new(4096, 1, 1).unwrap(),
            ttl: None,
            connections: 2,
            io_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        };
        let mut backend = RedisBackend::open(&options).unwrap();
        let mut dest = vec![0u8; 4096];
        let mut outcomes = Vec::new();
        let dest = crate::storage::BlockBytesMut::new(&mut dest);
        backend.get(&mut [GetBlock { hash: BlockHash(1), dest }], &mut outcomes);
        assert_eq!(outcomes, vec![Err(GetMiss::Failed(Failure::Unavailable))]);
        // In back-off now: the next call fails without trying.
        let mut present = Vec::new();
        backend.contains(&[BlockHash(1), BlockHash(2)], &mut present);
        assert_eq!(present, vec![Err(Failure::Unavailable), Err(Failure::Unavailable)]);
    }
}
