//! `kvshm tier-owner`: the owner process of a host tier several engine instances share (DESIGN
//! §12.3-12.4).
//!
//! 1. build the tier's identity from the arguments, and its index;
//! 2. create the tier's control object ([`TierServer::create`]): refused while another owner of
//!    the name lives, a dead owner's taken over;
//! 3. print one JSON line (`{"tier": NAME, "pid": PID, ...}`) to stdout: the tier is served;
//! 4. serve turns ([`TierServer::turn`]) until SIGTERM or SIGINT, printing one JSON line
//!    (`{"released": {...}}`) for each client let go, then print the owner's counters as one
//!    JSON line and remove the control object.

use anyhow::Context;
use clap::Parser;
use kvshm_ipc::name::SegmentName;
use kvshm_ipc::tier_control::TierConfig;

use crate::offload::{OffloadConfig, SharedTierIndex, TierIdentity, TierServer};
use crate::worker::process::{install_stop_handlers, stop_requested};

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
    /// Chunks of the tier.
    #[arg(long)]
    chunks: u32,
    /// Client slots.
    #[arg(long, default_value_t = 16)]
    clients: u32,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let identity = TierIdentity {
        model: args.model,
        kv_dtype: args.kv_dtype,
        block_tokens: args.block_tokens,
        block_bytes: args.block_bytes,
        blocks_per_chunk: args.blocks_per_chunk,
        layout: args.layout,
    };
    let name = args.name.unwrap_or_else(|| identity.tier_name());
    let name = SegmentName::new(&name).context("the tier's name")?;
    let index = SharedTierIndex::new(identity, OffloadConfig::new(args.chunks))?;
    install_stop_handlers().context("installing the stop handlers")?;
    let mut server = TierServer::create(&name, index, &TierConfig::with_clients(args.clients))?;
    let ready = serde_json::json!({ "tier": name.as_str(), "pid": std::process::id(), "chunks": args.chunks });
    println!("{ready}");
    while !stop_requested() {
        server.turn();
        for gone in server.take_gone() {
            println!("{}", serde_json::json!({ "released": gone }));
        }
    }
    println!("{}", serde_json::json!({ "tier": name.as_str(), "stats": server.stats() }));
    Ok(())
}
