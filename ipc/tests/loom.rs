//! Loom models of the ring and the doorbell: every interleaving (up to `LOOM_MAX_PREEMPTIONS`
//! preemptions) of small producer/consumer programs.
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom cargo test -p kvshm-ipc --test loom --release`
//!
//! The heap ring under loom keeps its slots in loom cells, so a consumer reading a slot the
//! producer is still writing (or a producer overwriting a slot before the consumer released it)
//! fails the model, as does any record arriving out of order. The doorbell's futex model has no
//! timeouts: a lost wake-up leaves the waiter blocked forever, which loom reports as a deadlock.
#![cfg(loom)]

use std::time::Duration;

use kvshm_ipc::doorbell::{Doorbell, WaitOutcome, WaitPolicy};
use kvshm_ipc::ring::{self, Consumer, Producer, RingFull};
use loom::sync::Arc;
use loom::thread;

/// Pops until `count` records arrived, yielding while the ring is empty.
fn pop_all(consumer: &mut Consumer<u64>, count: usize, batch: usize) -> Vec<u64> {
    let mut out = Vec::new();
    while out.len() < count {
        if consumer.pop_into(&mut out, batch).expect("a sound producer never corrupts the ring")
            == 0
        {
            thread::yield_now();
        }
    }
    out
}

/// Pushes `records` as one batch, yielding while the ring has no room for it.
fn push_batch(producer: &mut Producer<u64>, records: &[u64]) {
    while let Err(RingFull) = producer.push_all(records) {
        thread::yield_now();
    }
}

#[test]
fn batches_arrive_whole_and_in_order() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(4);
        let writer = thread::spawn(move || {
            push_batch(&mut producer, &[1, 2]);
            push_batch(&mut producer, &[3]);
        });
        let out = pop_all(&mut consumer, 3, 4);
        assert_eq!(out, [1, 2, 3]);
        writer.join().unwrap();
    });
}

#[test]
fn slots_are_reused_safely_when_a_ring_of_two_wraps() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let writer = thread::spawn(move || {
            for record in 1..=4 {
                push_batch(&mut producer, &[record]);
            }
        });
        let mut out = Vec::new();
        while out.len() < 4 {
            match consumer.pop().expect("a sound producer never corrupts the ring") {
                Some(record) => out.push(record),
                None => thread::yield_now(),
            }
        }
        assert_eq!(out, [1, 2, 3, 4]);
        writer.join().unwrap();
    });
}

#[test]
fn a_consumer_polling_a_filling_ring_reads_only_published_slots() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let writer = thread::spawn(move || {
            push_batch(&mut producer, &[7, 8]);
            push_batch(&mut producer, &[9]);
        });
        // Poll with a batch size of one while the producer fills and wraps the ring.
        let out = pop_all(&mut consumer, 3, 1);
        assert_eq!(out, [7, 8, 9]);
        writer.join().unwrap();
    });
}

/// Waits on the doorbell for at least one record, with no spinning so the futex path is taken.
fn wait_for_record(doorbell: &Doorbell, consumer: &mut Consumer<u64>) -> u64 {
    let policy = WaitPolicy::new(0, Duration::from_secs(1));
    let outcome = doorbell.wait_until(
        || !consumer.is_empty().expect("a sound producer never corrupts the ring"),
        policy,
    );
    assert_eq!(outcome, WaitOutcome::Ready);
    consumer.pop().unwrap().expect("the waiter saw a published record")
}

#[test]
fn a_waiter_is_never_left_asleep_after_a_publish() {
    loom::model(|| {
        let doorbell = Arc::new(Doorbell::new());
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let publisher = {
            let doorbell = doorbell.clone();
            thread::spawn(move || {
                producer.push(42).unwrap();
                doorbell.ring();
            })
        };
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 42);
        publisher.join().unwrap();
    });
}

#[test]
fn a_waiter_is_never_left_asleep_across_two_rounds() {
    loom::model(|| {
        let doorbell = Arc::new(Doorbell::new());
        let (mut producer, mut consumer) = ring::heap::<u64>(2);
        let publisher = {
            let doorbell = doorbell.clone();
            thread::spawn(move || {
                for record in [1, 2] {
                    producer.push(record).unwrap();
                    doorbell.ring();
                }
            })
        };
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 1);
        assert_eq!(wait_for_record(&doorbell, &mut consumer), 2);
        publisher.join().unwrap();
    });
}

#[test]
fn a_request_and_its_reply_never_strand_either_side() {
    loom::model(|| {
        let requests_bell = Arc::new(Doorbell::new());
        let replies_bell = Arc::new(Doorbell::new());
        let (mut requests, mut requests_in) = ring::heap::<u64>(1);
        let (mut replies, mut replies_in) = ring::heap::<u64>(1);
        let server = {
            let (requests_bell, replies_bell) = (requests_bell.clone(), replies_bell.clone());
            thread::spawn(move || {
                let request = wait_for_record(&requests_bell, &mut requests_in);
                replies.push(request + 1).unwrap();
                replies_bell.ring();
            })
        };
        requests.push(10).unwrap();
        requests_bell.ring();
        assert_eq!(wait_for_record(&replies_bell, &mut replies_in), 11);
        server.join().unwrap();
    });
}
