//! `kvshm worker` as a real process, driven through its rings by a test playing the scheduler
//! (or by a service): copies, bad commands, exits, set-up under load, and its storage commands.

#[path = "../support/mod.rs"]
mod support;

mod process;
mod startup;
mod storage;
mod tier_pages;
