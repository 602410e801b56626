//! `kvshm tier-owner`: the owner process of a host tier several engine instances share (DESIGN
//! §12.3-12.4).
//!
//! 1. build the tier's identity from the arguments; stop if an owner of the name lives;
//! 2. make the tier's arenas, one per rank, or take over those a previous owner left, with their
//!    size ([`TierArenas::create_or_adopt`]; with `--adopt-arenas` take over only, at their
//!    block size: [`TierArenas::adopt_existing`]), and an index of as many chunks;
//! 3. create the tier's control object, closed to clients ([`TierServer::create_closed`]):
//!    refused while another owner of the name lives, a dead owner's taken over; then open the
//!    tier's key table ([`TierKeys`]) and, after a takeover, take back the keys it names and
//!    refuse stores for the grace; with `--storage`, open the storage tier below
//!    ([`TierStorage`]) and list what it holds;
//! 4. open the control object to clients and print one JSON line (`{"tier": NAME, "pid": PID,
//!    ...}`) to stdout: the tier is served (an owner that fails before prints `{"tier": NAME,
//!    "pid": PID, "failed": WHY, "another_owner_may_serve": BOOL, "held_the_name": BOOL}`
//!    instead, for the engines waiting: [`Failure`]);
//! 5. serve turns ([`TierServer::turn`]) until SIGTERM or SIGINT (or, with `--idle-exit-s`, until
//!    no client has been attached for that long and no other process maps an arena), printing
//!    one JSON line (`{"released": {...}}`) for each client let go, then write to storage what
//!    waits to be written, print the owner's counters as one JSON line and remove the control
//!    object. The arenas and the key table stay for the next owner (engines keep the arenas
//!    mapped), except after an idle exit, when no engine is left to map them.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::{TierConfig, TierControl};

use crate::offload::shared::{
    TierArenaError, TierArenas, TierKeys, TierStorage, DEFAULT_FREE_CHUNKS, OWNER_SPIN,
};
use crate::offload::{OffloadConfig, SharedTierIndex, TierIdentity, TierServer};
use crate::storage::spec::{spec_given, StorageOptions, StorageSpec};
use crate::worker::process::{install_stop_handlers, stop_requested};

/// The longest a stopping owner spends writing to storage what waits to be written.
const STORAGE_DRAIN_LIMIT: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
pub struct Args {
    /// The tier's name; by default the one its identity gives (`kvshm-tier-MODEL-DIGEST`).
    #[arg(long)]
    name: Option<String>,
    /// The model, as the engines name it.
    #[arg(long)]
    model: String,
    /// The KV cache's element type.
    #[arg(long, default_value = "float16")]
    kv_dtype: String,
    /// Tokens per engine block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Bytes of one block on one rank, all layers.
    #[arg(long)]
    block_bytes: u64,
    /// Engine blocks per chunk of the tier.
    #[arg(long, default_value_t = 1)]
    blocks_per_chunk: u32,
    /// The rest of the layout, as the engines spell it.
    #[arg(long, default_value = "")]
    layout: String,
    /// Chunks of a new tier (a tier whose arenas are taken over keeps their size).
    #[arg(long, required_unless_present = "adopt_arenas", conflicts_with = "adopt_arenas")]
    chunks: Option<u32>,
    /// Bytes of one block in the arenas, when they differ from `--block-bytes` (the engine's
    /// own count): every KV tensor's page of one block, as the engine's copies lay it out.
    #[arg(long, conflicts_with = "adopt_arenas")]
    arena_block_bytes: Option<u64>,
    /// Take over the arenas a previous owner left, as they are, and make none: a restart for
    /// engines that still map them (an engine restarts the owner it finds gone this way).
    #[arg(long)]
    adopt_arenas: bool,
    /// Ranks (tensor-parallel workers) of each engine: one arena each (1 to 1,024).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    ranks: u32,
    /// Client slots.
    #[arg(long, default_value_t = 16)]
    clients: u32,
    /// The most chunks each client may hold: a client at its quota evicts its own least
    /// recently used blocks to store more, so that no engine flushes the others'.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    client_quota: Option<u32>,
    /// Exit, removing the tier and its arenas, once no client has been attached for this many
    /// seconds (counted from the start too). Without it, the owner serves until stopped.
    #[arg(long)]
    idle_exit_s: Option<u64>,
    /// After taking over a previous owner's arenas, refuse stores this long: that owner's
    /// clients may still be copying into chunks it handed them.
    #[arg(long, default_value_t = 10_000)]
    takeover_grace_ms: u64,
    /// A storage tier below this one (`disk:DIR` or `redis://HOST[:PORT][/DB]`): every block
    /// stored is written there too, and one evicted from the arenas is brought back from there
    /// when an engine asks for it.
    #[arg(long)]
    storage: Option<String>,
    /// Read the storage tier's spec from `KVSHM_STORAGE` (see `kvshm worker`).
    #[arg(long, conflicts_with = "storage")]
    storage_from_env: bool,
    /// Chunks the storage holds per rank (disk; by default 4 times the tier's chunks).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    storage_chunks: Option<u64>,
    /// Chunks kept free ahead of demand, evicted between batches so that a store waits on no
    /// eviction (at most a 256th of the tier; 0: none).
    #[arg(long, default_value_t = DEFAULT_FREE_CHUNKS)]
    free_chunks: u32,
    /// Microseconds the owner spins for the next batch before it sleeps: a core busy while
    /// engines call, against a wake-up of tens of microseconds on their next wait.
    #[arg(long, default_value_t = OWNER_SPIN.as_micros() as u64)]
    spin_us: u64,
}

/// An owner that stopped before it served: why, whether another owner of the name may serve in
/// its place, and whether it held the name. A starter that lost the race for the name (or for
/// making the arenas) to another engine's owner says so, and its engine waits for that one;
/// any other failure (a storage tier it cannot open, arenas of another shape, a bad option) is
/// its own, and its engine stops waiting at once with the reason. An owner that failed holding
/// the name was the one every engine starting then waits for: they stop waiting too
/// (`kvshm.shared_tier.wait_for_tier_owner`).
#[derive(Debug)]
struct Failure {
    error: anyhow::Error,
    another_owner_may_serve: bool,
    held_the_name: bool,
}

impl Failure {
    /// A failure of this owner's own, before it took the name.
    fn own(error: impl Into<anyhow::Error>) -> Failure {
        Failure { error: error.into(), another_owner_may_serve: false, held_the_name: false }
    }

    /// A failure that another owner starting meanwhile may have caused: an arena or the
    /// control object taken by it, or being made. Also any other error at those steps (a full
    /// `/dev/shm`), which cannot be told apart: its engine waits the wait out.
    fn maybe_lost_race(error: impl Into<anyhow::Error>) -> Failure {
        Failure { error: error.into(), another_owner_may_serve: true, held_the_name: false }
    }

    /// A failure of this owner's own once the name was its own (closed to clients).
    fn holding_the_name(error: impl Into<anyhow::Error>) -> Failure {
        Failure { error: error.into(), another_owner_may_serve: false, held_the_name: true }
    }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(error: E) -> Failure {
        Failure::own(error)
    }
}

/// Serves a tier (module flow); an owner that fails before it serves prints its [`Failure`] as
/// one JSON line on stdout, then returns the error.
pub fn run(args: Args) -> anyhow::Result<()> {
    let tier = args.name.clone().unwrap_or_else(|| identity_of(&args).tier_name());
    serve(args).map_err(|failure| {
        let line = serde_json::json!({
            "tier": tier,
            "pid": std::process::id(),
            "failed": format!("{:#}", failure.error),
            "another_owner_may_serve": failure.another_owner_may_serve,
            "held_the_name": failure.held_the_name,
        });
        // After `serve` dropped the control object: whoever reads this finds the name free.
        println!("{line}");
        failure.error
    })
}

/// The identity of the tier the arguments describe.
fn identity_of(args: &Args) -> TierIdentity {
    TierIdentity {
        model: args.model.clone(),
        kv_dtype: args.kv_dtype.clone(),
        block_tokens: args.block_tokens,
        block_bytes: args.block_bytes,
        blocks_per_chunk: args.blocks_per_chunk,
        layout: args.layout.clone(),
    }
}

fn serve(args: Args) -> Result<(), Failure> {
    // Parsed here, not by clap, whose refusal would print the spec whole (a password with it).
    let storage = spec_given(args.storage.as_deref(), args.storage_from_env)?
        .map(|spec| spec.parse::<StorageSpec>())
        .transpose()?;
    if storage.is_none() && args.storage_chunks.is_some() {
        return Err(Failure::own(anyhow::anyhow!(
            "--storage-chunks sizes a storage tier, and none was given"
        )));
    }
    let identity = identity_of(&args);
    let name = args.name.unwrap_or_else(|| identity.tier_name());
    let name = SegmentName::new(&name).context("the tier's name")?;
    if let Ok(control) = TierControl::attach(&name) {
        let pid = control.owner().pid;
        let error = anyhow::anyhow!("tier {name} is served by a live owner (pid {pid})");
        return Err(Failure::maybe_lost_race(error));
    }
    if let Some(pid) = TierControl::setting_up(&name) {
        let error = anyhow::anyhow!("tier {name} is being set up by a live owner (pid {pid})");
        return Err(Failure::maybe_lost_race(error));
    }
    let blocks_per_chunk = u64::from(args.blocks_per_chunk.max(1));
    let arenas = match args.chunks {
        _ if args.adopt_arenas => TierArenas::adopt_existing(&name, args.ranks),
        Some(chunks) => {
            let blocks = u64::from(chunks) * blocks_per_chunk;
            let block_bytes = args.arena_block_bytes.unwrap_or(identity.block_bytes);
            TierArenas::create_or_adopt(&name, args.ranks, blocks, block_bytes)
        }
        None => {
            return Err(Failure::own(anyhow::anyhow!("--chunks is needed unless --adopt-arenas")))
        }
    };
    // An arena another owner is making (or made) meanwhile; a shape that disagrees is not that.
    let arenas = arenas.map_err(|error| match error {
        TierArenaError::Arena { .. } => Failure::maybe_lost_race(error),
        _ => Failure::own(error),
    })?;
    let chunks = u32::try_from(arenas.blocks() / blocks_per_chunk)
        .context("the tier's arenas hold more chunks than a tier may")?;
    let mut index = SharedTierIndex::new(identity.clone(), OffloadConfig::new(chunks))?;
    index.keep_free(args.free_chunks);
    install_stop_handlers().context("installing the stop handlers")?;
    // Closed to clients until it serves: an engine that finds it serving finds an owner that
    // has opened its key table and storage tier, not one that may still fail on them.
    let config = TierConfig::with_clients(args.clients);
    let mut server =
        TierServer::create_closed(&name, index, &config).map_err(Failure::maybe_lost_race)?;
    // The key table once the name is this owner's (`O_EXCL` on the control object): a starter
    // that loses the race touches it not at all. No client is served before it is read.
    let (keys, entries) = TierKeys::open(&name, &identity, chunks, arenas.adopted())
        .context("the tier's key table")
        .map_err(Failure::holding_the_name)?;
    let keys_restored = server.owner().index().keep_key_table(keys, entries);
    if let Some(spec) = &storage {
        let mut options = StorageOptions::new(spec.clone());
        options.capacity_blocks = args.storage_chunks;
        let storage =
            TierStorage::open(&name, args.ranks, chunks, &options, server.owner().index())
                .with_context(|| format!("the storage tier {spec}"))
                .map_err(Failure::holding_the_name)?;
        server.keep_storage(storage);
    }
    server.set_client_quota(args.client_quota);
    server.set_spin(Duration::from_micros(args.spin_us));
    if arenas.adopted() {
        server.refuse_stores_until(Instant::now() + Duration::from_millis(args.takeover_grace_ms));
    }
    let ready = serde_json::json!({
        "tier": name.as_str(),
        "pid": std::process::id(),
        "chunks": chunks,
        "free_chunks": server.owner().index().free_target(),
        "ranks": args.ranks,
        "arenas_taken_over": arenas.adopted(),
        "keys_restored": keys_restored,
        "storage": storage.as_ref().map(ToString::to_string),
        "storage_namespace": storage.as_ref().map(|_| identity.storage_namespace()),
        "storage_held": server.storage().map(|storage| storage.stats().held_at_start),
    });
    server.open_to_clients();
    println!("{ready}");
    let idle_exit = args.idle_exit_s.map(Duration::from_secs);
    let mut last_attached = Instant::now();
    let mut idle = false;
    while !stop_requested() {
        server.turn();
        for gone in server.take_gone() {
            println!("{}", serde_json::json!({ "released": gone }));
        }
        if server.clients_attached() > 0 {
            last_attached = Instant::now();
        } else if idle_exit.is_some_and(|limit| last_attached.elapsed() >= limit) {
            // An engine may map an arena without being attached (its copy side starts before
            // its scheduler attaches): the tier then stays, and the idle time starts again.
            if arenas.mapped_elsewhere() {
                last_attached = Instant::now();
                continue;
            }
            idle = true;
            break;
        }
    }
    // What waits to be written goes to storage before the owner ends.
    server.drain_storage(STORAGE_DRAIN_LIMIT);
    let storage = server.storage().map(TierStorage::stats);
    println!(
        "{}",
        serde_json::json!({
            "tier": name.as_str(),
            "idle_exit": idle,
            "stats": server.stats(),
            "storage": storage,
        })
    );
    // The control object goes first: no client attaches to a tier whose arenas are gone.
    drop(server);
    if idle {
        arenas.remove();
    }
    Ok(())
}
