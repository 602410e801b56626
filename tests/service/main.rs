//! The service (the cache manager on a transport) and the transport under it, with real
//! `kvshm worker` processes: the engine API, layer-wise swap-ins, direct copies, liveness,
//! recovery from dead, stopped and scribbled-over workers, and the storage tier beneath.

#[path = "../support/mod.rs"]
mod support;

mod direct;
mod e2e;
mod engine_api;
mod layers;
mod liveness;
mod recovery;
mod storage;
mod storage_misses;
