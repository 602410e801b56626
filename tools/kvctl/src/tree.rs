//! `kvctl tree`: the scheduler's snapshot of the radix tree, as an indented tree or raw JSON.
//!
//! kvctl cannot walk the tree itself (it lives in the scheduler's heap), so it asks for a snapshot
//! through the segment's control area ([`Control::fetch_snapshot`]); the scheduler's `poll()`
//! serialises the manager's `TreeSnapshot` (flat, depth-first, children by hash, each node naming
//! its parent) into the snapshot area. [`TreeView`] mirrors that schema for reading.
//!
//! Flow: 1. attach; 2. request a snapshot of the asked depth and wait up to the timeout; 3. parse
//! it (a schema kvctl cannot read is an error, never a panic); 4. print the raw JSON (`--json`) or
//! one line per node indented by depth (up to [`MAX_INDENT_LEVELS`]).
//!
//! [`Control::fetch_snapshot`]: kvshm_ipc::control::Control::fetch_snapshot

use std::io::{self, Write};
use std::time::Duration;

use kvshm_ipc::control::DEPTH_UNLIMITED;
use kvshm_ipc::segment::Segment;
use serde::Deserialize;

use crate::error::KvctlError;
use crate::text::{self, Table};

/// Hex digits of a node's hash shown in the text view.
pub const HASH_PREFIX_DIGITS: usize = 12;
/// Levels the text view indents at most; deeper nodes (long conversation chains) line up at this
/// indentation and the DEPTH column tells their level.
pub const MAX_INDENT_LEVELS: u32 = 16;

/// The scheduler's tree snapshot (the manager's `TreeSnapshot`, as JSON).
#[derive(Debug, Clone, Deserialize)]
pub struct TreeView {
    /// Cached blocks in the whole tree.
    pub total_nodes: u64,
    pub max_depth: u32,
    /// Depth-first, children by hash; the root is not listed.
    pub nodes: Vec<NodeView>,
}

/// One node of a [`TreeView`].
#[derive(Debug, Clone, Deserialize)]
pub struct NodeView {
    pub id: u32,
    /// `None` under the root.
    pub parent: Option<u32>,
    pub depth: u32,
    /// 32 hex digits.
    pub hash: String,
    pub state: String,
    pub device: Option<u32>,
    pub host: Option<u32>,
    pub ref_count: u32,
    pub hit_count: u32,
    #[serde(default)]
    pub last_access: u64,
    /// Children in the tree (some may lie below the snapshot's depth).
    #[serde(default)]
    pub children: u32,
}

/// A snapshot as received: the JSON text and its parsed view.
#[derive(Debug, Clone)]
pub struct TreeSnapshot {
    pub segment: String,
    pub json: String,
    pub view: TreeView,
}

/// Asks the scheduler of `segment` for the tree down to `depth` (all of it when `None`).
pub fn fetch(
    segment: &Segment,
    depth: Option<u32>,
    timeout: Duration,
) -> Result<TreeSnapshot, KvctlError> {
    let depth = depth.unwrap_or(DEPTH_UNLIMITED);
    let json = segment
        .control()
        .fetch_snapshot(depth, timeout)
        .map_err(|error| KvctlError::from_control(segment, error))?;
    let view = serde_json::from_str(&json).map_err(|source| KvctlError::BadSnapshot {
        segment: segment.name().to_string(),
        source,
    })?;
    Ok(TreeSnapshot { segment: segment.name().to_string(), json, view })
}

impl TreeSnapshot {
    /// The JSON exactly as the scheduler wrote it.
    pub fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        writeln!(out, "{}", self.json.trim_end())
    }

    /// One line per node, indented two spaces per level below the root.
    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let view = &self.view;
        let depth = if view.max_depth == DEPTH_UNLIMITED {
            "all levels".to_owned()
        } else {
            format!("down to depth {}", view.max_depth)
        };
        writeln!(
            out,
            "segment {}: {} cached blocks; showing {} ({depth})",
            self.segment,
            view.total_nodes,
            view.nodes.len()
        )?;
        if view.nodes.is_empty() {
            return Ok(());
        }
        let mut table =
            Table::new(&["HASH", "DEPTH", "STATE", "DEVICE", "HOST", "REF", "HITS", ""]);
        for node in &view.nodes {
            let indent = "  ".repeat(node.depth.saturating_sub(1).min(MAX_INDENT_LEVELS) as usize);
            let prefix: String = node.hash.chars().take(HASH_PREFIX_DIGITS).collect();
            let below = if node.depth >= view.max_depth && node.children > 0 {
                format!("(+{} below)", node.children)
            } else {
                String::new()
            };
            table.push(vec![
                format!("{indent}{prefix}"),
                node.depth.to_string(),
                node.state.clone(),
                text::or_dash(node.device),
                text::or_dash(node.host),
                node.ref_count.to_string(),
                node.hit_count.to_string(),
                below,
            ]);
        }
        table.write(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SNAPSHOT: &str = r#"{"total_nodes":3,"max_depth":1,"nodes":[
        {"id":1,"parent":null,"depth":1,"hash":"00112233445566778899aabbccddeeff","state":"device",
         "device":4,"host":null,"ref_count":1,"hit_count":2,"last_access":9,"children":2}]}"#;

    #[test]
    fn nodes_cut_off_by_the_depth_say_how_many_children_lie_below() {
        let view: TreeView = serde_json::from_str(SNAPSHOT).unwrap();
        let snapshot = TreeSnapshot { segment: "s".into(), json: SNAPSHOT.into(), view };
        let mut out = Vec::new();
        snapshot.write_text(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("segment s: 3 cached blocks; showing 1 (down to depth 1)"));
        assert!(text.contains("001122334455  1      device  4"), "{text}");
        assert!(text.contains("(+2 below)"), "{text}");
    }

    #[test]
    fn deep_chains_stop_indenting_at_the_cap() {
        let deep = SNAPSHOT
            .replace(r#""depth":1"#, r#""depth":40"#)
            .replace("\"max_depth\":1", "\"max_depth\":99");
        let view: TreeView = serde_json::from_str(&deep).unwrap();
        let snapshot = TreeSnapshot { segment: "s".into(), json: deep, view };
        let mut out = Vec::new();
        snapshot.write_text(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let indent = " ".repeat(2 * MAX_INDENT_LEVELS as usize);
        assert!(text.contains(&format!("\n{indent}001122334455  40")), "{text}");
    }

    #[test]
    fn a_snapshot_without_its_fields_is_refused() {
        assert!(serde_json::from_str::<TreeView>(r#"{"nodes":[]}"#).is_err());
    }
}
