//! Which worker ids registered which engine URL, so a registration checks the workers sharing
//! its engine instead of every connected worker (issue 17, item 4: registering a fleet of `n`
//! workers was `O(n^2)`).
//!
//! The index holds, for each engine URL, the ids whose last accepted registration named it. It
//! is updated when a registration's owner is recorded (the only place a worker's URL changes);
//! whether one of those ids is connected now is read from its mailbox at check time, so the
//! index never goes stale on a connect or a disconnect.

use std::collections::{BTreeSet, HashMap};

/// Engine URL -> the worker ids whose last registration named it.
#[derive(Debug, Default)]
pub(crate) struct EngineIndex {
    by_url: HashMap<String, BTreeSet<String>>,
}

impl EngineIndex {
    /// Records that `worker_id` moved from engine `old` to engine `new` (either may be `None`).
    pub(crate) fn set(&mut self, worker_id: &str, old: Option<&str>, new: Option<&str>) {
        if old == new {
            return;
        }
        if let Some(url) = old {
            if let Some(ids) = self.by_url.get_mut(url) {
                ids.remove(worker_id);
                if ids.is_empty() {
                    self.by_url.remove(url);
                }
            }
        }
        if let Some(url) = new {
            self.by_url
                .entry(url.to_string())
                .or_default()
                .insert(worker_id.to_string());
        }
    }

    /// The ids registered with engine `url`, other than `worker_id` (ascending).
    pub(crate) fn others(&self, url: &str, worker_id: &str) -> Vec<String> {
        self.by_url.get(url).map_or_else(Vec::new, |ids| {
            ids.iter()
                .filter(|id| id.as_str() != worker_id)
                .cloned()
                .collect()
        })
    }

    /// Number of engine URLs indexed.
    #[cfg(test)]
    fn urls(&self) -> usize {
        self.by_url.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_follows_each_workers_last_engine() {
        let mut ix = EngineIndex::default();
        ix.set("a", None, Some("http://e1"));
        ix.set("b", None, Some("http://e1"));
        ix.set("c", None, Some("http://e2"));
        assert_eq!(ix.others("http://e1", "a"), vec!["b".to_string()]);
        assert_eq!(
            ix.others("http://e1", "z"),
            vec!["a".to_string(), "b".into()]
        );
        // b re-registers on another engine: it leaves e1.
        ix.set("b", Some("http://e1"), Some("http://e3"));
        assert!(ix.others("http://e1", "a").is_empty());
        assert_eq!(ix.others("http://e3", "a"), vec!["b".to_string()]);
        // a re-registers without an engine: e1 is gone from the index.
        ix.set("a", Some("http://e1"), None);
        assert!(ix.others("http://e1", "z").is_empty());
        assert_eq!(ix.urls(), 2);
        // The same engine again changes nothing.
        ix.set("c", Some("http://e2"), Some("http://e2"));
        assert_eq!(ix.others("http://e2", "z"), vec!["c".to_string()]);
    }
}
