//! Where the demo's requests come from: the conversation trace, or a built-in stand-in.
//!
//! The demo prefers the Mooncake conversation trace (`--trace FILE`, else the copy the repository
//! carries in `traces/`). Where there is none, [`synthetic_conversations`] makes a
//! deterministic workload of the same shape: sessions that share a system prompt and whose turns
//! grow their own history, interleaved so that older sessions come back after others pushed them
//! out of the device tier.

use std::path::{Path, PathBuf};

use kvshm::trace::TraceRequest;

/// The trace file name in the repository's `traces/`.
const TRACE_FILE: &str = "mooncake_conversation_trace.jsonl";

/// The repository's copy of the conversation trace, if it is at hand: `traces/` under the working
/// directory, or under the source tree this binary was built from.
pub fn default_trace() -> Option<PathBuf> {
    let from_cwd = Path::new("traces").join(TRACE_FILE);
    let from_source = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces").join(TRACE_FILE);
    [from_cwd, from_source].into_iter().find(|path| path.is_file())
}

/// `sessions` conversations of `turns` turns each, with a shared system prompt of
/// `system_blocks` blocks; turn t of a session adds `turn_blocks` blocks to its history. Requests
/// are interleaved round-robin over the sessions.
pub fn synthetic_conversations(
    sessions: u32,
    turns: u32,
    system_blocks: u32,
    turn_blocks: u32,
    block_tokens: u32,
) -> Vec<TraceRequest> {
    let mut next_id = u64::from(system_blocks);
    let mut histories: Vec<Vec<u64>> =
        (0..sessions).map(|_| (0..u64::from(system_blocks)).collect()).collect();
    let mut requests = Vec::with_capacity((sessions * turns) as usize);
    for turn in 0..turns {
        for (session, history) in histories.iter_mut().enumerate() {
            for _ in 0..turn_blocks {
                history.push(next_id);
                next_id += 1;
            }
            // A partial last block, as real prompts have.
            let block_tokens = block_tokens as usize;
            let input_length = history.len() * block_tokens - block_tokens / 3;
            requests.push(TraceRequest {
                timestamp: u64::from(turn) * 1000 + session as u64,
                input_length,
                output_length: block_tokens / 2 + (session % 7) * 16,
                hash_ids: history.clone(),
            });
        }
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_sessions_share_the_system_prompt_and_grow_their_history() {
        let requests = synthetic_conversations(3, 2, 2, 4, 512);
        assert_eq!(requests.len(), 6);
        assert!(requests.iter().all(|request| request.hash_ids[..2] == [0, 1]));
        let first_turn = &requests[0].hash_ids;
        let second_turn = &requests[3].hash_ids;
        assert_eq!(second_turn[..first_turn.len()], first_turn[..]);
        assert_eq!(second_turn.len(), first_turn.len() + 4);
        assert_ne!(requests[0].hash_ids[2..], requests[1].hash_ids[2..]);
        assert!(requests[0].input_length <= requests[0].hash_ids.len() * 512);
    }
}
