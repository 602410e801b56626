//! The engine-facing cache manager API that porting vLLM's, SGLang's and FastDeploy's prefix-cache
//! tests asked for: checked token counts, capacity queries, releasing and re-matching requests,
//! forced resets that name what they dropped, and cascade-attention prefixes.

mod scheduler_support;

use kvshm::manager::{AllocateError, RequestId};
use scheduler_support::*;

#[test]
fn an_absurd_token_count_is_a_typed_error_that_changes_nothing() {
    let mut cache = device_only(8);
    serve(&mut cache, 1, &hashes(&[1, 2]));
    let request = RequestId(2);
    cache.match_prefix(request, &hashes(&[1, 2]), 9).unwrap();
    let free = cache.free_device_blocks();
    for (new_tokens, lookahead) in [(usize::MAX, 0), (usize::MAX - 4, 8), (1, usize::MAX)] {
        assert_eq!(
            cache.allocate(request, new_tokens, lookahead).unwrap_err(),
            AllocateError::TooManyTokens { request, new_tokens, lookahead }
        );
        assert_eq!(cache.free_device_blocks(), free);
        check(&cache);
    }
    assert_eq!(cache.allocate(request, 4, 0).unwrap().new_blocks, 1);
    check(&cache);
}
