//! The storage tier's back-ends on their own: the disk slab and Redis, their checksums and
//! indexes, writers killed mid-write, full disks and servers that stop or hang.

#[path = "../support/mod.rs"]
mod support;

mod disk;
mod redis;
