//! The Redis storage back-end against a real `redis-server`: round trips, the key and value
//! format, sharing between services, damaged values, a server that goes away and comes back,
//! a full server, and a writer SIGKILLed in the middle of its pipelines.

use std::process::Stdio;
use std::time::{Duration, Instant};

use kvshm::hash::BlockHash;
use kvshm::storage::redis::{block_key, key_prefix, RedisBackend, RedisOptions};
use kvshm::storage::{
    BlockBytes, BlockBytesMut, BlockKey, BlockLayout, Failure, GetBlock, GetMiss, PutBlock,
    StorageBackend,
};

use crate::support::{
    connect, pattern_bytes, redis_for_test, rerun_test, unique_namespace, RedisServer,
};

const BLOCK: usize = 16 * 1024;
/// Set in a re-executed copy of this binary that plays a writer to be killed.
const WRITER_ENV: &str = "KVSHM_TEST_REDIS_WRITER";

fn layout() -> BlockLayout {
    BlockLayout::new(BLOCK as u64, 4, 2).unwrap()
}

fn options(url: &str, namespace: &str) -> RedisOptions {
    RedisOptions {
        url: url.to_owned(),
        namespace: namespace.to_owned(),
        rank: 1,
        layout: layout(),
        ttl: None,
        connections: 3,
        io_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(1),
    }
}

fn content(tag: u64) -> Vec<u8> {
    pattern_bytes(tag, BLOCK)
}

fn key(tag: u64) -> BlockKey {
    BlockKey::new(
        BlockHash(u128::from(tag) << 64 | 0x7ed15),
        BlockHash(u128::from(tag) - 1),
        tag as u32,
    )
}

fn put(backend: &mut RedisBackend, tags: &[u64]) -> Vec<Result<(), Failure>> {
    let contents: Vec<Vec<u8>> = tags.iter().map(|&tag| content(tag)).collect();
    let blocks: Vec<PutBlock<'_>> = tags
        .iter()
        .zip(&contents)
        .map(|(&tag, bytes)| PutBlock { key: key(tag), bytes: BlockBytes::new(bytes) })
        .collect();
    let mut outcomes = Vec::new();
    backend.put(&blocks, &mut outcomes);
    outcomes
}

/// Gets `tags`; every hit must hold exactly its block's bytes.
fn get(backend: &mut RedisBackend, tags: &[u64]) -> Vec<Result<(), GetMiss>> {
    let mut dests: Vec<Vec<u8>> = tags.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut blocks: Vec<GetBlock<'_>> = tags
        .iter()
        .zip(&mut dests)
        .map(|(&tag, dest)| GetBlock { hash: key(tag).hash, dest: BlockBytesMut::new(dest) })
        .collect();
    let mut outcomes = Vec::new();
    backend.get(&mut blocks, &mut outcomes);
    for ((tag, dest), outcome) in tags.iter().zip(&dests).zip(&outcomes) {
        if outcome.is_ok() {
            assert!(*dest == content(*tag), "block {tag} came back with wrong bytes");
        }
    }
    outcomes
}

fn all_ok<E: std::fmt::Debug>(outcomes: &[Result<(), E>]) -> bool {
    outcomes.iter().all(Result::is_ok)
}

#[test]
fn blocks_round_trip_through_redis_under_their_documented_keys() {
    let redis = redis_for_test();
    let namespace = unique_namespace("roundtrip");
    let mut backend = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    let tags: Vec<u64> = (1..=20).collect();
    assert!(all_ok(&put(&mut backend, &tags)));
    assert!(all_ok(&get(&mut backend, &[20, 3, 7, 3, 1])));
    assert_eq!(get(&mut backend, &[2, 99])[1], Err(GetMiss::Absent));

    // The key names namespace, layout, hash and rank; the value is header + bytes.
    let expected_key = format!("kvshm:{namespace}:tp2-r4x4096:{}:1", key(5).hash);
    assert_eq!(block_key(&key_prefix(&namespace, &layout()), key(5).hash, 1), expected_key);
    let mut raw = connect(&redis.url());
    let value: Vec<u8> = redis::cmd("GET").arg(&expected_key).query(&mut raw).unwrap();
    assert_eq!(value.len(), 80 + BLOCK);
    assert_eq!(&value[..8], b"KVSHMRV1");
    assert!(value[80..] == content(5)[..]);

    let mut present = Vec::new();
    backend.contains(&[key(1).hash, key(99).hash], &mut present);
    assert_eq!(present, vec![Ok(true), Ok(false)]);
    let mut removed = Vec::new();
    backend.remove(&[key(1).hash, key(2).hash], &mut removed);
    assert!(all_ok(&removed));
    assert_eq!(
        get(&mut backend, &[1, 2, 3]),
        vec![Err(GetMiss::Absent), Err(GetMiss::Absent), Ok(())]
    );
}

#[test]
fn a_ttl_expires_blocks_and_every_read_renews_it() {
    ttl_expires_blocks_and_every_read_renews_it(&redis_for_test().url());
}

#[test]
fn a_ttl_works_on_a_server_without_getex() {
    // Redis before 6.2 has no GETEX.
    let old = RedisServer::start_with(&["--rename-command", "GETEX", ""]);
    let mut raw = connect(&old.url());
    let refused = redis::cmd("GETEX").arg("k").query::<Option<Vec<u8>>>(&mut raw);
    assert!(refused.is_err(), "the server still has GETEX");
    ttl_expires_blocks_and_every_read_renews_it(&old.url());
}

/// Blocks stored with a time to live of 100 s: a read renews it, and a block whose time ran out
/// is a miss.
fn ttl_expires_blocks_and_every_read_renews_it(url: &str) {
    let namespace = unique_namespace("ttl");
    let mut options = options(url, &namespace);
    options.ttl = Some(Duration::from_secs(100));
    let mut backend = RedisBackend::open(&options).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2])));
    let mut raw = connect(url);
    let key_of = |tag| block_key(&key_prefix(&namespace, &layout()), key(tag).hash, 1);
    let ttl: i64 = redis::cmd("TTL").arg(key_of(1)).query(&mut raw).unwrap();
    assert!((90..=100).contains(&ttl), "ttl {ttl}");
    let _: () = redis::cmd("EXPIRE").arg(key_of(1)).arg(5).query(&mut raw).unwrap();
    assert!(all_ok(&get(&mut backend, &[1, 2])));
    let renewed: i64 = redis::cmd("TTL").arg(key_of(1)).query(&mut raw).unwrap();
    assert!(renewed > 5, "a read did not renew the ttl ({renewed})");
    let _: () = redis::cmd("PEXPIRE").arg(key_of(2)).arg(1).query(&mut raw).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(get(&mut backend, &[1, 2]), vec![Ok(()), Err(GetMiss::Absent)]);
}

#[test]
fn two_services_with_one_namespace_share_blocks_and_other_namespaces_or_layouts_do_not() {
    let redis = redis_for_test();
    let namespace = unique_namespace("shared");
    let mut first = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    let mut second = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    assert!(all_ok(&put(&mut first, &[1, 2, 3])));
    assert!(all_ok(&put(&mut second, &[4])));
    assert!(all_ok(&get(&mut second, &[1, 2, 3])));
    assert!(all_ok(&get(&mut first, &[4])));

    let mut elsewhere =
        RedisBackend::open(&options(&redis.url(), &unique_namespace("other"))).unwrap();
    assert_eq!(get(&mut elsewhere, &[1]), vec![Err(GetMiss::Absent)]);
    let other_tp = RedisOptions {
        layout: BlockLayout::new(BLOCK as u64, 4, 4).unwrap(),
        ..options(&redis.url(), &namespace)
    };
    let mut other_layout = RedisBackend::open(&other_tp).unwrap();
    assert_eq!(get(&mut other_layout, &[1]), vec![Err(GetMiss::Absent)]);
}

#[test]
fn a_damaged_redis_value_is_a_miss() {
    let redis = redis_for_test();
    let namespace = unique_namespace("corrupt");
    let mut backend = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2, 3, 4])));
    let mut raw = connect(&redis.url());
    let key_of = |tag| block_key(&key_prefix(&namespace, &layout()), key(tag).hash, 1);
    // A flipped byte in the block, a truncated value, another block's value, a foreign value.
    let _: i64 = redis::cmd("SETRANGE")
        .arg(key_of(1))
        .arg(80 + 1000)
        .arg(&[0xffu8][..])
        .query(&mut raw)
        .unwrap();
    let value: Vec<u8> = redis::cmd("GET").arg(key_of(2)).query(&mut raw).unwrap();
    let _: () =
        redis::cmd("SET").arg(key_of(2)).arg(&value[..value.len() - 1]).query(&mut raw).unwrap();
    let _: () = redis::cmd("COPY")
        .arg(key_of(4))
        .arg(key_of(3))
        .arg("REPLACE")
        .query(&mut raw)
        .map(|_: i64| ())
        .unwrap();
    let _: () = redis::cmd("SET").arg(key_of(4)).arg("hello").query(&mut raw).unwrap();
    assert_eq!(get(&mut backend, &[1, 2, 3, 4]), vec![Err(GetMiss::Corrupt); 4]);
    // Storing again repairs them.
    assert!(all_ok(&put(&mut backend, &[1, 2, 3, 4])));
    assert!(all_ok(&get(&mut backend, &[1, 2, 3, 4])));
}

#[test]
fn a_redis_that_goes_away_gives_quick_counted_misses_and_is_reconnected_when_it_returns() {
    let mut server = RedisServer::start();
    let namespace = unique_namespace("away");
    let mut backend = RedisBackend::open(&options(&server.url(), &namespace)).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2, 3])));
    let connects_before = backend.stats().connects;

    server.kill();
    let started = Instant::now();
    let misses = get(&mut backend, &[1, 2, 3]);
    assert!(
        misses
            .iter()
            .all(|m| matches!(m, Err(GetMiss::Failed(Failure::Unavailable | Failure::Timeout)))),
        "{misses:?}"
    );
    let stores = put(&mut backend, &[4, 5, 6]);
    assert!(
        stores.iter().all(|s| matches!(s, Err(Failure::Unavailable | Failure::Timeout))),
        "{stores:?}"
    );
    let mut present = Vec::new();
    backend.contains(&[key(1).hash], &mut present);
    assert!(present[0].is_err());
    println!("three calls against a dead server took {:?}", started.elapsed());

    server.restart();
    // The back-off is at most a second; keep trying for much longer than that.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let outcomes = put(&mut backend, &[7, 8, 9]);
        if all_ok(&outcomes) {
            break;
        }
        assert!(Instant::now() < deadline, "never reconnected: {outcomes:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(all_ok(&get(&mut backend, &[7, 8, 9])));
    // The restarted server kept nothing: the old blocks are plain misses now.
    assert_eq!(get(&mut backend, &[1]), vec![Err(GetMiss::Absent)]);
    assert!(backend.stats().connects > connects_before);
}

/// Pooled connections the server closed while they sat idle (its `timeout`, a proxy, a
/// restart) cost no block: each part goes once more on a fresh connection. Before, every part
/// of the next batch failed as unavailable, and the scheduler dropped those blocks as gone.
#[test]
fn connections_the_server_closed_while_idle_cost_no_block() {
    let server = RedisServer::start();
    let mut backend =
        RedisBackend::open(&options(&server.url(), &unique_namespace("idle"))).unwrap();
    assert!(all_ok(&put(&mut backend, &[1, 2, 3])), "one part on each of the 3 connections");
    let connects = backend.stats().connects;
    let mut raw = connect(&server.url());
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query(&mut raw)
        .unwrap();
    assert_eq!(killed, 3, "the pool's connections");
    assert!(all_ok(&get(&mut backend, &[1, 2, 3])), "{:?}", get(&mut backend, &[1, 2, 3]));
    assert_eq!(backend.stats().connects, connects + 3, "each part reconnected once");
    assert!(all_ok(&put(&mut backend, &[4, 5, 6])));
}

#[test]
fn a_full_redis_refuses_blocks_as_no_space() {
    let server = RedisServer::start();
    let mut raw = connect(&server.url());
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query(&mut raw)
        .unwrap();
    let mut backend =
        RedisBackend::open(&options(&server.url(), &unique_namespace("full"))).unwrap();
    assert!(all_ok(&put(&mut backend, &[1])));
    let used: String = redis::cmd("INFO").arg("memory").query(&mut raw).unwrap();
    let used: u64 = used
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used + 40 * 1024)
        .query(&mut raw)
        .unwrap();
    let outcomes = put(&mut backend, &(10..30).collect::<Vec<u64>>());
    let no_space = outcomes.iter().filter(|o| **o == Err(Failure::NoSpace)).count();
    assert!(no_space > 0, "{outcomes:?}");
    assert!(outcomes.iter().all(|o| o.is_ok() || *o == Err(Failure::NoSpace)), "{outcomes:?}");
    assert!(all_ok(&get(&mut backend, &[1])), "what was stored before stays readable");
}

#[test]
fn a_writer_killed_in_the_middle_of_its_pipelines_leaves_no_block_with_wrong_bytes() {
    if let Ok(spec) = std::env::var(WRITER_ENV) {
        // The writer: store blocks 1.. forever, in batches of 8, until killed.
        let (url, namespace) = spec.split_once('|').unwrap();
        let mut backend = RedisBackend::open(&options(url, namespace)).unwrap();
        for batch in 0u64.. {
            let tags: Vec<u64> = (batch * 8 + 1..=batch * 8 + 8).collect();
            put(&mut backend, &tags);
            println!("stored {}", batch * 8 + 8);
        }
        return;
    }
    let redis = redis_for_test();
    let namespace = unique_namespace("killed");
    let test = "a_writer_killed_in_the_middle_of_its_pipelines_leaves_no_block_with_wrong_bytes";
    let mut child = rerun_test(module_path!(), test)
        .args(["--test-threads", "1"])
        .env(WRITER_ENV, format!("{}|{namespace}", redis.url()))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Let it write for a while (at least one batch), then SIGKILL it.
    let mut raw = connect(&redis.url());
    let pattern = format!("kvshm:{namespace}:*");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut raw).unwrap();
        if keys.len() >= 40 {
            break;
        }
        assert!(Instant::now() < deadline, "the writer stored only {} blocks", keys.len());
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let mut reader = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    let tags: Vec<u64> = (1..=4000).collect();
    let mut hits = 0;
    for chunk in tags.chunks(32) {
        let outcomes = get(&mut reader, chunk);
        assert!(
            outcomes.iter().all(|o| *o == Ok(()) || *o == Err(GetMiss::Absent)),
            "{outcomes:?}"
        );
        hits += outcomes.iter().filter(|o| o.is_ok()).count();
    }
    assert!(hits >= 40, "only {hits} blocks readable");
    println!("{hits} blocks stored before the kill, all with the right bytes");
}

#[test]
fn dropping_a_namespace_unlinks_its_keys_and_no_other_namespaces() {
    use kvshm::storage::drop::drop_namespace;
    use kvshm::storage::spec::{StorageNamespace, StorageSpec};
    let redis = redis_for_test();
    let (dropped_ns, kept_ns) = (unique_namespace("drop"), unique_namespace("keep"));
    let mut connection = connect(&redis.url());
    for index in 0..2_500 {
        for namespace in [&dropped_ns, &kept_ns] {
            let _: () = redis::cmd("SET")
                .arg(format!("kvshm:{namespace}:tp1-r2x64:{index:032x}:0"))
                .arg(b"x".as_slice())
                .query(&mut connection)
                .unwrap();
        }
    }
    let spec = StorageSpec::Redis { url: redis.url() };
    let namespace = StorageNamespace::new(&dropped_ns).unwrap();
    let dropped = drop_namespace(&spec, &namespace, Duration::from_secs(5)).unwrap();
    assert_eq!(dropped.keys, 2_500);
    let left = |namespace: &str, connection: &mut redis::Connection| -> usize {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("kvshm:{namespace}:*")).query(connection).unwrap();
        keys.len()
    };
    assert_eq!(left(&dropped_ns, &mut connection), 0);
    assert_eq!(left(&kept_ns, &mut connection), 2_500);
    let kept = StorageNamespace::new(&kept_ns).unwrap();
    assert_eq!(drop_namespace(&spec, &kept, Duration::from_secs(5)).unwrap().keys, 2_500);
}

#[test]
fn a_starting_scheduler_lists_the_blocks_every_rank_holds_with_their_parents_and_depths() {
    use kvshm::storage::redis_listing::blocks_on_every_rank;
    let redis = redis_for_test();
    let namespace = unique_namespace("listing");
    let mut rank_0 =
        RedisBackend::open(&RedisOptions { rank: 0, ..options(&redis.url(), &namespace) }).unwrap();
    let mut rank_1 = RedisBackend::open(&options(&redis.url(), &namespace)).unwrap();
    assert!(put(&mut rank_0, &[3, 4, 5]).iter().all(Result::is_ok));
    assert!(put(&mut rank_1, &[3, 4]).iter().all(Result::is_ok), "block 5 lacks rank 1's part");
    // A damaged rank-0 value of a block both ranks seem to hold is not listed either.
    assert!(put(&mut rank_0, &[6]).iter().all(Result::is_ok));
    assert!(put(&mut rank_1, &[6]).iter().all(Result::is_ok));
    let prefix = key_prefix(&namespace, &layout());
    let mut connection = connect(&redis.url());
    let _: () = redis::cmd("SETRANGE")
        .arg(block_key(&prefix, key(6).hash, 0))
        .arg(0)
        .arg(b"garbage!".as_slice())
        .query(&mut connection)
        .unwrap();
    let listed =
        blocks_on_every_rank(&redis.url(), &namespace, &layout(), Duration::from_secs(5)).unwrap();
    let found: Vec<(BlockHash, BlockHash, u32)> =
        listed.iter().map(|block| (block.hash, block.parent, block.depth)).collect();
    assert_eq!(found, [3, 4].map(|tag| (key(tag).hash, key(tag).parent, key(tag).depth)));
    let other = unique_namespace("listing-empty");
    assert!(blocks_on_every_rank(&redis.url(), &other, &layout(), Duration::from_secs(5))
        .unwrap()
        .is_empty());
}
