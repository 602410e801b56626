//! Rule tests of `conv`: generations, ghosts, turn ends, classes and the learned time scale.

use super::*;

const DEVICE: Membership = Membership::from_bits(1);
const HOST: Membership = Membership::from_bits(2);

fn key(value: u128) -> BlockHash {
    BlockHash(value)
}

fn conv(device_blocks: u32, host_blocks: u32) -> Conv {
    let mut conv = Conv::default();
    conv.reserve_nodes(16);
    conv.configure(TierShape { device_blocks, host_blocks });
    conv
}

/// Ends a request of generation `generation` that held `path` (tail released first), filing
/// each node in `sets`; marks the path's end as a turn's end.
fn finished(conv: &mut Conv, generation: u8, path: &[u32], sets: Membership) {
    conv.request_ending(generation);
    for &node in path.iter().rev() {
        conv.touch(NodeId(node), key(node.into()), Access::Release);
        conv.enter(NodeId(node), sets);
    }
    conv.turn_ended(NodeId(*path.last().unwrap()));
}

fn started(conv: &mut Conv, deepest: Option<(u32, bool)>, next_key: Option<u128>) -> u8 {
    let deepest = deepest.map(|(node, leaf)| (NodeId(node), leaf));
    conv.request_started(MatchEnd { deepest, next_key: next_key.map(key) })
}

fn order(conv: &Conv, set: EvictSet) -> Vec<u32> {
    let mut order = Vec::new();
    conv.visit(set, &mut |node| {
        order.push(node.0);
        ControlFlow::Continue(())
    });
    order
}

#[test]
fn only_a_request_extending_a_marked_leaf_continues_a_conversation() {
    let mut conv = conv(64, 0);
    finished(&mut conv, 1, &[1, 2], DEVICE);
    assert_eq!(started(&mut conv, Some((2, true)), None), 2, "the end of the turn");
    assert_eq!(started(&mut conv, Some((1, false)), None), 1, "inside the turn");
    conv.request_ending(1);
    conv.touch(NodeId(3), key(3), Access::Release); // a leaf never finished: no mark
    assert_eq!(started(&mut conv, Some((3, true)), None), 1);
    assert_eq!(started(&mut conv, None, Some(2)), 1, "no ghost of a live node");
}

#[test]
fn a_conversation_evicted_whole_is_recognised_by_its_ghost_once() {
    let mut conv = conv(64, 0);
    finished(&mut conv, 3, &[1], DEVICE);
    conv.leave(NodeId(1), DEVICE);
    conv.removing(NodeId(1), key(1), None);
    assert_eq!(conv.meta[1], 0, "the removed node's state is cleared");
    assert_eq!(started(&mut conv, None, Some(99)), 1, "another key");
    assert_eq!(started(&mut conv, None, Some(1)), 4, "the ghost's generation + 1");
    assert_eq!(started(&mut conv, None, Some(1)), 1, "a ghost is taken once");
}

#[test]
fn a_trimmed_chain_passes_its_turn_end_to_its_parent() {
    let mut conv = conv(64, 0);
    finished(&mut conv, 2, &[1, 2], DEVICE);
    conv.leave(NodeId(2), DEVICE);
    conv.removing(NodeId(2), key(2), Some(NodeId(1)));
    assert_eq!(started(&mut conv, None, Some(2)), 1, "no ghost: the parent took the mark");
    assert_eq!(started(&mut conv, Some((1, true)), None), 3);
}

#[test]
fn continued_chains_and_hot_prefixes_are_kept_tau_longer_per_class() {
    let mut conv = conv(64, 0);
    conv.tau = 100;
    finished(&mut conv, 3, &[1], DEVICE); // class 2, stamp 0: score 200
    conv.touch(NodeId(2), key(2), Access::Hit);
    conv.touch(NodeId(2), key(2), Access::Hit);
    conv.touch(NodeId(2), key(2), Access::Hit);
    finished(&mut conv, 1, &[2], DEVICE); // 4 hits: class 3, stamp 1: score 301
    finished(&mut conv, 1, &[3], DEVICE); // class 0, stamp 2: score 2
    assert_eq!(order(&conv, EvictSet::Device), vec![3, 1, 2]);
    assert_eq!(conv.first(EvictSet::Device), Some(NodeId(3)));
    let membership =
        |node: NodeId| Some(if (1..=3).contains(&node.0) { DEVICE } else { Membership::NONE });
    conv.check(&membership).unwrap();
    conv.tau = 0;
    assert_eq!(order(&conv, EvictSet::Device), vec![1, 2, 3], "tau 0: plain LRU");
}

#[test]
fn the_device_tier_above_a_host_tier_is_plain_lru_and_the_host_tier_ages() {
    let mut conv = conv(64, 256);
    conv.tau = 100;
    let both = DEVICE.with(EvictSet::Host);
    finished(&mut conv, 3, &[1], both);
    finished(&mut conv, 1, &[2], HOST);
    finished(&mut conv, 1, &[3], DEVICE);
    assert_eq!(order(&conv, EvictSet::Device), vec![1, 3]);
    assert_eq!(order(&conv, EvictSet::Host), vec![2, 1]);
    assert_eq!((conv.len(EvictSet::Device), conv.len(EvictSet::Host)), (2, 2));
    assert_eq!(conv.first(EvictSet::Host), Some(NodeId(2)));
}

#[test]
fn tau_stays_zero_until_32_gaps_then_follows_their_median() {
    let mut conv = conv(64, 0);
    for _ in 0..WARMUP - 1 {
        conv.observe_gap(1000);
    }
    assert_eq!(conv.tau, 0);
    conv.observe_gap(1000);
    assert!((830..=1200).contains(&conv.tau), "tau {}", conv.tau);
    for _ in 0..3 * HALVING_PERIOD {
        conv.observe_gap(40_000);
    }
    assert!((33_000..=48_000).contains(&conv.tau), "tau {}", conv.tau);
}

#[test]
fn ghost_gaps_are_measured_to_within_a_coarse_stamp() {
    let mut conv = Conv::with_clock(5_000);
    conv.reserve_nodes(4);
    conv.configure(TierShape { device_blocks: 64, host_blocks: 0 });
    conv.remember(key(1), 1_000, 2);
    let (generation, gap) = conv.recall(key(1)).unwrap();
    assert_eq!(generation, 2);
    assert!(gap.abs_diff(4_000) <= 64, "gap {gap}");
}

#[test]
fn a_full_ghost_bucket_forgets_its_oldest_ghost() {
    let mut conv = conv(4, 0); // one bucket
    for value in 1..=WAYS as u128 + 1 {
        conv.lists.advance_clock(1 << GHOST_STAMP_SHIFT);
        conv.remember(key(value), conv.lists.clock(), 1);
    }
    assert!(conv.recall(key(1)).is_none(), "the oldest went");
    for value in 2..=WAYS as u128 + 1 {
        assert!(conv.recall(key(value)).is_some(), "ghost {value}");
    }
}

#[test]
fn running_out_of_stamps_renumbers_them_in_order() {
    let mut conv = Conv::with_clock(u32::MAX - 2);
    conv.reserve_nodes(6);
    conv.request_ending(1);
    for node in [4, 2] {
        conv.touch(NodeId(node), key(0), Access::Release);
        conv.enter(NodeId(node), DEVICE);
    }
    conv.touch(NodeId(5), key(0), Access::Release); // not filed: keeps its place too
    for node in [0, 3] {
        conv.touch(NodeId(node), key(0), Access::Release);
        conv.enter(NodeId(node), DEVICE);
    }
    assert!(conv.lists.clock() < 10, "renumbered: clock {}", conv.lists.clock());
    conv.enter(NodeId(5), DEVICE);
    assert_eq!(order(&conv, EvictSet::Device), vec![4, 2, 5, 0, 3]);
    let membership = |node: NodeId| Some(if node.0 != 1 { DEVICE } else { Membership::NONE });
    conv.check(&membership).unwrap();
}
