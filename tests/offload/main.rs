//! The offload layer, for engines that keep their own device cache and keys: the offload manager
//! (vLLM's contract) and one rank's host tier on a transport of its own.

#[path = "../support/mod.rs"]
mod support;

mod host_tier;
mod manager;
mod shared_tier;
mod tier_lease;
mod tier_owner;
mod tier_process;
mod tier_storage;
