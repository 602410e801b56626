//! Differential test of the write-back run ([`Tree::write_back_run`]) against the general,
//! per-victim form of the same evictions ([`Tree::update`], [`Tree::remove`] and the first
//! candidates of the sets), as the cache manager's general path does them without a storage
//! tier.

use super::twin_tests::Twins;
use super::*;
use crate::test_rng::picker;

/// A device block an allocation took: from a write-back (the node and its host block), or not.
type Taken = (u32, Option<(NodeId, u32)>);

/// The test's side of a run: a host pool (a stack, as [`crate::pool::BlockPool`]'s free list)
/// and the blocks taken.
struct Sink<'a> {
    pool: &'a mut Vec<u32>,
    taken: &'a mut Vec<Taken>,
}

impl WriteBackSink for Sink<'_> {
    fn free_host_blocks(&self) -> usize {
        self.pool.len()
    }

    fn take_free_host_block(&mut self) -> u32 {
        self.pool.pop().expect("a free block")
    }

    fn written_back(&mut self, id: NodeId, device: u32, host: u32) {
        self.taken.push((device, Some((id, host))));
    }

    fn device_copy_dropped(&mut self, device: u32) {
        self.taken.push((device, None));
    }
}

/// Cases the general form met, to show that the random trees reach each of them.
#[derive(Debug, Default)]
struct Met {
    copies_dropped: usize,
    written_back: usize,
    host_from_pool: usize,
    host_with_device: usize,
    /// Host-only parents that became host candidates as their last child left.
    host_parents_exposed: usize,
    dropped: usize,
}

/// Evicts the first device candidate of `tree` for an allocation by the general form (the
/// manager's `evict_device` for an allocation without a storage tier): drops its device copy
/// if it has a backup; else, if `min_hits` says a copy is wanted and a host block can be had
/// (the pool's, else the first host candidate's: a host-only one leaves the tree, one with a
/// device copy only loses its host copy), starts its claimed swap-out by copy `copy` (opened
/// by the first write-back); else drops it with the host-only nodes below it, their host blocks
/// back to the pool.
fn evict_generally(
    tree: &mut Tree,
    pool: &mut Vec<u32>,
    min_hits: u32,
    copy: &mut Option<u64>,
    opened: u64,
    taken: &mut Vec<Taken>,
    met: &mut Met,
) {
    let victim = tree.first_device_candidate().expect("counted");
    let node = tree.node(victim);
    let device = node.device().unwrap();
    if node.has_valid_host() {
        tree.update(victim, |node| {
            node.set_device(None);
            node.set_state(NodeState::Host);
        });
        taken.push((device, None));
        met.copies_dropped += 1;
        return;
    }
    if node.hit_count() >= min_hits {
        let host = if let Some(block) = pool.pop() {
            met.host_from_pool += 1;
            Some(block)
        } else if let Some(host_victim) = tree.first_host_candidate() {
            let block = tree.node(host_victim).host().unwrap();
            if tree.node(host_victim).device().is_some() {
                met.host_with_device += 1;
                tree.update(host_victim, |node| node.set_host(None));
            } else {
                let parent = tree.node(host_victim).parent().unwrap();
                let was_candidate = tree.node(parent).membership().contains(EvictSet::Host);
                tree.remove(host_victim);
                let is_candidate = parent != NodeId::ROOT
                    && tree.node(parent).membership().contains(EvictSet::Host);
                met.host_parents_exposed += usize::from(is_candidate && !was_candidate);
            }
            Some(block)
        } else {
            None
        };
        if let Some(host) = host {
            let copy = *copy.get_or_insert(opened);
            tree.update(victim, |node| {
                node.set_device(None);
                node.set_host(Some(host));
                node.set_state(NodeState::SwapToHost(SwapOut::Claimed));
                node.set_transfer(Some(copy));
            });
            taken.push((device, Some((victim, host))));
            met.written_back += 1;
            return;
        }
    }
    // Dropped with the host-only nodes below it, children first.
    met.dropped += 1;
    while let Some(mut leaf) = tree.first_child(victim) {
        while let Some(child) = tree.first_child(leaf) {
            leaf = child;
        }
        pool.extend(tree.node(leaf).host());
        tree.remove(leaf);
    }
    tree.remove(victim);
    taken.push((device, None));
}

/// An allocation's evictions by write-back runs, applied to one of two trees built alike, take
/// the device blocks (and host blocks, and write back the nodes) that the general form takes
/// one victim at a time in the other, in that order, and leave the same tree: node fields,
/// sets, counts, the policy's order and stamps, and the host pool. The runs hand back to the
/// general form the victims they do not evict (no copy wanted, no host block, a host victim
/// with a device copy), and write back into the copy they are given.
#[test]
fn write_back_runs_evict_what_the_general_form_evicts_one_victim_at_a_time() {
    let mut met = Met::default();
    let (mut runs_ended_general, mut runs_writing_back) = (0, 0);
    for policy in EvictionPolicy::online() {
        for seed in 1..=40u64 {
            let mut rnd = picker(seed);
            let mut t = Twins::new(policy);
            for step in 0..250 {
                let what = format!("{policy:?} seed {seed} step {step}");
                match rnd(12) {
                    0..=2 => {
                        // A request's new blocks under the root or a device copy, served.
                        t.serve_chain(&mut rnd, &what);
                    }
                    // A backup lands on a device node without a host copy.
                    3 | 4 => t.land_host_copy(&mut rnd),
                    5 => {
                        // Claimed swap-outs land: their nodes become host-only.
                        for id in t.ids() {
                            let claimed =
                                t.a.node(id).state() == NodeState::SwapToHost(SwapOut::Claimed);
                            if claimed && rnd(2) == 0 {
                                let transfer = t.a.node(id).transfer().unwrap();
                                assert_eq!(
                                    t.a.land_attached_claimed_swap_out(id, transfer),
                                    Landing::Landed
                                );
                                t.b.update(id, |node| {
                                    node.set_state(NodeState::Host);
                                    node.set_transfer(None);
                                    node.set_passing_through_host(false);
                                });
                            }
                        }
                    }
                    6 => t.free_host_blocks(&mut rnd),
                    7 => t.hold_or_release(&mut rnd),
                    _ => {
                        // An allocation short of blocks: `b` evicts victim by victim.
                        let min_hits = [0, 0, 0, 0, 0, 2][rnd(6)];
                        let opened = t.new_copy();
                        let (mut taken_b, mut copy_b) = (Vec::new(), None);
                        for _ in 0..1 + rnd(8) {
                            if t.b.first_device_candidate().is_none() {
                                break;
                            }
                            evict_generally(
                                &mut t.b,
                                &mut t.pool_b,
                                min_hits,
                                &mut copy_b,
                                opened,
                                &mut taken_b,
                                &mut met,
                            );
                        }
                        // `a` evicts as many in runs, handing back what they leave.
                        let (mut taken_a, mut copy_a) = (Vec::new(), None);
                        let mut run = WriteBackRun::default();
                        let mut ignored = Met::default();
                        let mut written_before = 0;
                        while taken_a.len() < taken_b.len() {
                            let left = taken_b.len() - taken_a.len();
                            let mut sink = Sink { pool: &mut t.pool_a, taken: &mut taken_a };
                            let end =
                                t.a.write_back_run(&mut run, left, min_hits, opened, &mut sink);
                            let wrote = run.written_back > written_before;
                            if wrote {
                                copy_a = Some(opened);
                                runs_writing_back += 1;
                            }
                            written_before = run.written_back;
                            match end {
                                RunEnd::Done => break,
                                RunEnd::General => {
                                    runs_ended_general += 1;
                                    if let Some(parent) = run.exposed.take() {
                                        t.a.file_exposed(parent, EvictSet::Device);
                                        assert_eq!(t.a.first_device_candidate(), Some(parent));
                                    }
                                    if let Some(parent) =
                                        run.exposed_host.take().filter(|&id| t.a.is_live(id))
                                    {
                                        t.a.file_exposed(parent, EvictSet::Host);
                                    }
                                    evict_generally(
                                        &mut t.a,
                                        &mut t.pool_a,
                                        min_hits,
                                        &mut copy_a,
                                        opened,
                                        &mut taken_a,
                                        &mut ignored,
                                    );
                                }
                            }
                        }
                        if let Some(parent) = run.exposed {
                            t.a.file_exposed(parent, EvictSet::Device);
                        }
                        if let Some(parent) = run.exposed_host.filter(|&id| t.a.is_live(id)) {
                            t.a.file_exposed(parent, EvictSet::Host);
                        }
                        assert_eq!(taken_a, taken_b, "{what}: the blocks taken");
                        assert_eq!(copy_a, copy_b, "{what}: the copy opened");
                        let counted = (run.written_back + run.device_copies_dropped) as usize;
                        assert!(counted <= taken_a.len(), "{what}: counted {counted}");
                    }
                }
                t.assert_same(&what);
            }
        }
    }
    let cases = format!(
        "cases met: {met:?}, runs ended for the general form {runs_ended_general}, runs \
         writing back {runs_writing_back}"
    );
    println!("{cases}");
    assert!(
        met.copies_dropped > 200
            && met.written_back > 500
            && met.host_from_pool > 100
            && met.host_with_device > 20
            && met.host_parents_exposed > 100
            && met.dropped > 20
            && runs_ended_general > 50
            && runs_writing_back > 100,
        "{cases}"
    );
}
