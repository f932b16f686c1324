//! Exact DSML replay memory (server.md §4.3): tool-call id → the raw DSML block the model
//! sampled, so a replayed assistant turn renders to the exact tokens in the KV cache.
//! Bounded: an LRU over ids, capped by count and by total block bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

const MAX_BYTES: usize = 512 << 20;

#[derive(Debug)]
pub struct ToolMemory {
    max_ids: usize,
    map: HashMap<String, (Arc<str>, u64)>,
    /// (id, stamp) in insertion/touch order; stale stamps are skipped on eviction.
    order: VecDeque<(String, u64)>,
    stamp: u64,
    bytes: usize,
}

impl ToolMemory {
    pub fn new(max_ids: usize) -> ToolMemory {
        ToolMemory {
            max_ids: max_ids.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
            stamp: 0,
            bytes: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Remembers that every id in `ids` was emitted in `block`.
    pub fn insert(&mut self, ids: &[String], block: &str) {
        if block.is_empty() {
            return;
        }
        let shared: Arc<str> = Arc::from(block);
        for id in ids {
            self.stamp += 1;
            if let Some((old, _)) = self.map.insert(id.clone(), (shared.clone(), self.stamp)) {
                self.bytes -= old.len();
            }
            self.bytes += block.len();
            self.order.push_back((id.clone(), self.stamp));
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.map.len() > self.max_ids || self.bytes > MAX_BYTES {
            let Some((id, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&id).is_some_and(|(_, s)| *s == stamp) {
                if let Some((b, _)) = self.map.remove(&id) {
                    self.bytes -= b.len();
                }
            }
        }
        // Keep the order queue from growing without bound through touches.
        if self.order.len() > 4 * self.max_ids.max(1024) {
            let map = &self.map;
            self.order
                .retain(|(id, s)| map.get(id).is_some_and(|(_, cur)| cur == s));
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<str>> {
        self.map.get(id).map(|(b, _)| b.clone())
    }

    /// The block when every id is known and all map to the same block.
    pub fn block_for_all(&self, ids: &[&str]) -> Option<String> {
        let first = self.get(ids.first()?)?;
        for id in &ids[1..] {
            if *self.get(id)? != *first {
                return None;
            }
        }
        Some(first.to_string())
    }

    /// Ids whose block occurs in `text`, grouped by block (for the KVC tool-map section).
    pub fn entries_in(&self, text: &str) -> Vec<(String, Arc<str>)> {
        let mut out: Vec<(String, Arc<str>)> = self
            .map
            .iter()
            .filter(|(_, (b, _))| text.contains(&**b) || text.contains(b.trim_start()))
            .map(|(id, (b, _))| (id.clone(), b.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_caps_ids() {
        let mut m = ToolMemory::new(2);
        m.insert(&["a".into()], "X");
        m.insert(&["b".into()], "Y");
        m.insert(&["c".into()], "Z");
        assert_eq!(m.len(), 2);
        assert!(m.get("a").is_none());
        assert_eq!(m.get("c").as_deref(), Some("Z"));
    }

    #[test]
    fn all_ids_must_share_a_block() {
        let mut m = ToolMemory::new(10);
        m.insert(&["a".into(), "b".into()], "B1");
        m.insert(&["c".into()], "B2");
        assert_eq!(m.block_for_all(&["a", "b"]).as_deref(), Some("B1"));
        assert_eq!(m.block_for_all(&["a", "c"]), None);
        assert_eq!(m.block_for_all(&["a", "zz"]), None);
    }
}
