//! Differential test of write-through's backup run ([`Tree::backup_run`]) and backup landing
//! ([`Tree::land_backup_swap_outs`]) against the general, per-node form of the same changes
//! ([`Tree::update`], [`Tree::remove`] and the first host candidate), as the cache manager's
//! `issue_backup` and `swap_out_landed` do them without a storage tier.

use super::twin_tests::Twins;
use super::*;
use crate::test_rng::picker;

/// The test's side of a run: a host pool (a stack, as [`crate::pool::BlockPool`]'s free list)
/// and the pairs of the copy, with their nodes.
struct Sink<'a> {
    pool: &'a mut Vec<u32>,
    pairs: &'a mut Vec<(NodeId, u32, u32)>,
}

impl BackupSink for Sink<'_> {
    fn free_host_blocks(&self) -> usize {
        self.pool.len()
    }

    fn take_free_host_block(&mut self) -> u32 {
        self.pool.pop().expect("a free block")
    }

    fn backed_up(&mut self, id: NodeId, device: u32, host: u32) {
        self.pairs.push((id, device, host));
    }
}

/// Cases the general form met, to show that the random trees reach each of them.
#[derive(Debug, Default)]
struct Met {
    started: usize,
    no_longer_wanted: usize,
    host_from_pool: usize,
    host_with_device: usize,
    host_dropped: usize,
    out_of_host: usize,
    landed: usize,
}

/// The manager's `issue_backup` of queued node `id` on `tree`: queued no more; if it is still
/// `Device` without a host copy and a host block can be had (the pool's, else the first host
/// candidate's: a host-only one leaves the tree, one with a device copy only loses its host
/// copy), its backup starts by copy `copy`. `out_of_host` as there.
fn back_up_generally(
    tree: &mut Tree,
    id: NodeId,
    pool: &mut Vec<u32>,
    copy: &mut Option<u64>,
    opened: u64,
    (pairs, out_of_host, met): (&mut Vec<(NodeId, u32, u32)>, &mut bool, &mut Met),
) {
    if !tree.is_live(id) || !tree.node(id).backup_queued() {
        return;
    }
    tree.update(id, |node| node.set_backup_queued(false));
    let node = tree.node(id);
    if *out_of_host || node.state() != NodeState::Device || node.host().is_some() {
        met.no_longer_wanted += usize::from(!*out_of_host);
        return;
    }
    let host = if let Some(block) = pool.pop() {
        met.host_from_pool += 1;
        block
    } else if let Some(victim) = tree.first_host_candidate() {
        let block = tree.node(victim).host().unwrap();
        if tree.node(victim).device().is_some() {
            met.host_with_device += 1;
            tree.update(victim, |node| node.set_host(None));
        } else {
            met.host_dropped += 1;
            tree.remove(victim);
        }
        block
    } else {
        met.out_of_host += 1;
        *out_of_host = true;
        return;
    };
    let copy = *copy.get_or_insert(opened);
    let device = tree.node(id).device().unwrap();
    tree.update(id, |node| {
        node.set_host(Some(host));
        node.set_state(NodeState::SwapToHost(SwapOut::Backup));
        node.set_transfer(Some(copy));
    });
    pairs.push((id, device, host));
    met.started += 1;
}

/// Backups started by runs, and landed in one pass, applied to one of two trees built alike,
/// take the host blocks and start the copies that the general form does node by node in the
/// other, in the queue's order, and leave the same tree: node fields, sets, counts, the policy's
/// order and stamps, and the host pool. The runs hand back to the general form the nodes they
/// do not back up (no host block, a host victim with a device copy), and ask for a copy before
/// their first backup only.
#[test]
fn backup_runs_and_their_landing_leave_what_the_general_form_leaves_node_by_node() {
    let mut met = Met::default();
    let (mut runs_ended_general, mut copies_asked) = (0, 0);
    for policy in EvictionPolicy::online() {
        for seed in 1..=40u64 {
            let mut rnd = picker(seed);
            let mut t = Twins::new(policy);
            let mut queue: Vec<NodeId> = Vec::new();
            for step in 0..250 {
                let what = format!("{policy:?} seed {seed} step {step}");
                let ids = t.ids();
                match rnd(12) {
                    0..=2 => {
                        // A request's new blocks under the root or a device copy, served and
                        // mostly queued for a backup.
                        let path = t.serve_chain(&mut rnd, &what);
                        if rnd(4) != 0 {
                            for &id in &path {
                                t.a.update(id, |node| node.set_backup_queued(true));
                                t.b.update(id, |node| node.set_backup_queued(true));
                            }
                            queue.extend_from_slice(&path);
                        }
                    }
                    // A device node without a host copy gets one some other way (a cancelled
                    // eviction landing): a queued one wants no backup any more.
                    3 if rnd(3) == 0 => t.land_host_copy(&mut rnd),
                    3 => {
                        // A device candidate with a backup is evicted: it is host-only now.
                        let list: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| {
                                t.a.is_device_candidate(id) && t.a.node(id).has_valid_host()
                            })
                            .collect();
                        if !list.is_empty() {
                            let id = list[rnd(list.len())];
                            for tree in [&mut t.a, &mut t.b] {
                                tree.update(id, |node| {
                                    node.set_device(None);
                                    node.set_state(NodeState::Host);
                                });
                            }
                        }
                    }
                    4 | 5 => {
                        // Backups land, a random part of them, each copy's in its order.
                        let backups: Vec<NodeId> = ids
                            .iter()
                            .copied()
                            .filter(|&id| {
                                t.a.node(id).state() == NodeState::SwapToHost(SwapOut::Backup)
                                    && rnd(3) != 0
                            })
                            .collect();
                        for &id in &backups {
                            let transfer = t.a.node(id).transfer().unwrap();
                            // A node detached from the copy (the root names none) is skipped.
                            let (through, landed) =
                                t.a.land_backup_swap_outs(&[NodeId::ROOT, id], transfer);
                            assert_eq!((through, landed), (2, 1), "{what}: landing {id:?}");
                            t.b.update(id, |node| {
                                node.set_state(NodeState::Device);
                                node.set_transfer(None);
                            });
                            met.landed += 1;
                        }
                    }
                    6 => t.free_host_blocks(&mut rnd),
                    7 => t.hold_or_release(&mut rnd),
                    8 if rnd(4) == 0 => {
                        // A leaf on host alone is dropped (so that its slot may be reused).
                        let leaf = ids.iter().copied().find(|&id| {
                            t.a.node(id).state() == NodeState::Host
                                && !t.a.node(id).has_children()
                                && t.a.node(id).ref_count() == 0
                        });
                        if let Some(id) = leaf {
                            t.a.remove(id);
                            t.b.remove(id);
                        }
                    }
                    _ => {
                        // `poll` issues the queued backups: `b` node by node.
                        let opened = t.new_copy();
                        let (mut pairs_b, mut copy_b, mut out_of_host) = (Vec::new(), None, false);
                        for &id in &queue {
                            let state = (&mut pairs_b, &mut out_of_host, &mut met);
                            back_up_generally(
                                &mut t.b,
                                id,
                                &mut t.pool_b,
                                &mut copy_b,
                                opened,
                                state,
                            );
                        }
                        // `a` in runs, handing back the nodes they leave.
                        let (mut pairs_a, mut copy_a) = (Vec::new(), None);
                        let mut run = BackupRun::default();
                        let mut ignored = Met::default();
                        loop {
                            let mut sink = Sink { pool: &mut t.pool_a, pairs: &mut pairs_a };
                            match t.a.backup_run(&mut run, &queue, copy_a, &mut sink) {
                                BackupEnd::Done => break,
                                BackupEnd::NeedsCopy
                                    if !t.pool_a.is_empty() || t.a.host_candidate_count() > 0 =>
                                {
                                    assert_eq!(copy_a, None, "{what}: a copy asked for twice");
                                    copy_a = Some(opened);
                                    copies_asked += 1;
                                }
                                BackupEnd::NeedsCopy | BackupEnd::General => {
                                    runs_ended_general += 1;
                                    if let Some(parent) =
                                        run.exposed_host.take().filter(|&id| t.a.is_live(id))
                                    {
                                        t.a.file_exposed(parent, EvictSet::Host);
                                    }
                                    // The next node, and once out of host blocks, the rest.
                                    assert!(run.next < queue.len(), "{what}: past the queue");
                                    let mut out_of_host = false;
                                    for &id in &queue[run.next..] {
                                        let state = (&mut pairs_a, &mut out_of_host, &mut ignored);
                                        let (tree, pool) = (&mut t.a, &mut t.pool_a);
                                        back_up_generally(
                                            tree,
                                            id,
                                            pool,
                                            &mut copy_a,
                                            opened,
                                            state,
                                        );
                                        run.next += 1;
                                        if !out_of_host {
                                            break;
                                        }
                                    }
                                    if out_of_host {
                                        break;
                                    }
                                }
                            }
                        }
                        if let Some(parent) = run.exposed_host.filter(|&id| t.a.is_live(id)) {
                            t.a.file_exposed(parent, EvictSet::Host);
                        }
                        queue.clear();
                        assert_eq!(pairs_a, pairs_b, "{what}: the copy's pairs");
                        assert_eq!(copy_a, copy_b, "{what}: the copy opened");
                        assert!(run.started as usize <= pairs_a.len(), "{what}");
                    }
                }
                t.assert_same(&what);
            }
        }
    }
    let cases = format!(
        "cases met: {met:?}, runs ended for the general form {runs_ended_general}, copies \
         asked for {copies_asked}"
    );
    println!("{cases}");
    assert!(
        met.started > 1000
            && met.no_longer_wanted > 10
            && met.host_from_pool > 500
            && met.host_with_device > 200
            && met.host_dropped > 80
            && met.out_of_host > 1000
            && met.landed > 1000
            && runs_ended_general > 1000
            && copies_asked > 500,
        "{cases}"
    );
}
