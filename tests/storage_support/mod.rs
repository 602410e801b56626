//! Support for the storage tests: private Redis servers ([`redis_server`]), scratch directories
//! ([`scratch`]), real `kvshm worker` processes with a storage tier and the scheduler's side of
//! their rank ([`worker`]), and the bytes and entries of test blocks ([`blocks`]).
//!
//! `scripts/test` starts one private `redis-server` for the whole run and exports its URL in
//! [`REDIS_URL_ENV`]; tests that only need a server use it ([`redis_for_test`]). Tests that stop
//! and restart their server, and runs without that variable (a plain `cargo test`), start their
//! own with [`RedisServer::start`] on a free loopback port; it is killed when dropped, also when
//! the test fails. Without `redis-server` installed the tests fail loudly: they never skip.
#![allow(dead_code)]

#[path = "../ring_driver/mod.rs"]
mod ring_driver;

pub mod blocks;
pub mod redis_server;
pub mod scratch;
pub mod worker;

// Each test binary uses a part of these.
#[allow(unused_imports)]
pub use blocks::*;
#[allow(unused_imports)]
pub use redis_server::*;
#[allow(unused_imports)]
pub use ring_driver::RingDriver;
#[allow(unused_imports)]
pub use scratch::*;
#[allow(unused_imports)]
pub use worker::*;
