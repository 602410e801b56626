//! The manager's index, from inside: keys that share a hash.

use super::*;

#[test]
fn keys_that_share_a_hash_stay_distinct_entries() {
    let mut manager = OffloadManager::new(OffloadConfig::new(8)).unwrap();
    let keys: Vec<OffloadKey> =
        (0u8..4).map(|byte| OffloadKey::with_hash_for_tests(&[byte; 36], 7)).collect();
    let mut out = PreparedStore::default();
    assert!(manager.prepare_store("r", &keys, &mut out));
    assert_eq!(out.to_store, vec![0, 1, 2, 3], "no key is taken for another");
    manager.complete_store(&keys[..2], true);
    assert_eq!(manager.peek(&keys[0]), LookupResult::Hit);
    assert_eq!(manager.peek(&keys[3]), LookupResult::HitPending);
    // Drop one from the middle of the chain, then one from its head.
    manager.complete_store(&keys[2..3], false);
    manager.complete_store(&keys[3..], false);
    assert_eq!(manager.peek(&keys[2]), LookupResult::Miss);
    assert_eq!(manager.peek(&keys[1]), LookupResult::Hit);
    manager.check_invariants().unwrap();
    let other = OffloadKey::with_hash_for_tests(&[9; 36], 7);
    assert_eq!(manager.peek(&other), LookupResult::Miss);
}
