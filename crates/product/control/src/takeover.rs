//! Which worker ids registered an engine at which address, so a registration checks the workers
//! sharing its engine instead of every connected worker (issue 17, item 4: registering a fleet
//! of `n` workers was `O(n^2)`).
//!
//! The index holds, for each engine address (`crate::identity::engine_addresses`: every
//! spelling of one socket address is one key, issue 29), the ids whose last accepted
//! registration reaches it. It
//! is updated when a registration's owner is recorded (the only place a worker's URL changes);
//! whether one of those ids is connected now is read from its mailbox at check time, so the
//! index never goes stale on a connect or a disconnect.

use std::collections::{BTreeSet, HashMap};

/// Engine address -> the worker ids whose last registration reaches it.
#[derive(Debug, Default)]
pub(crate) struct EngineIndex {
    by_url: HashMap<String, BTreeSet<String>>,
}

impl EngineIndex {
    /// Records that `worker_id` moved from the engine addresses `old` to `new` (either may be
    /// empty).
    pub(crate) fn set(&mut self, worker_id: &str, old: &[String], new: &[String]) {
        if old == new {
            return;
        }
        for url in old {
            if let Some(ids) = self.by_url.get_mut(url) {
                ids.remove(worker_id);
                if ids.is_empty() {
                    self.by_url.remove(url);
                }
            }
        }
        for url in new {
            self.by_url
                .entry(url.to_string())
                .or_default()
                .insert(worker_id.to_string());
        }
    }

    /// The ids registered with an engine at any of `addresses`, other than `worker_id`
    /// (ascending, each once).
    pub(crate) fn others(&self, addresses: &[String], worker_id: &str) -> Vec<String> {
        let ids: BTreeSet<&String> = addresses
            .iter()
            .filter_map(|a| self.by_url.get(a))
            .flatten()
            .filter(|id| id.as_str() != worker_id)
            .collect();
        ids.into_iter().cloned().collect()
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
        let a = |s: &str| vec![s.to_string()];
        let none: Vec<String> = Vec::new();
        let mut ix = EngineIndex::default();
        ix.set("a", &none, &a("e1"));
        ix.set("b", &none, &a("e1"));
        ix.set("c", &none, &a("e2"));
        assert_eq!(ix.others(&a("e1"), "a"), vec!["b".to_string()]);
        assert_eq!(ix.others(&a("e1"), "z"), vec!["a".to_string(), "b".into()]);
        // b re-registers on another engine: it leaves e1.
        ix.set("b", &a("e1"), &a("e3"));
        assert!(ix.others(&a("e1"), "a").is_empty());
        assert_eq!(ix.others(&a("e3"), "a"), vec!["b".to_string()]);
        // a re-registers without an engine: e1 is gone from the index.
        ix.set("a", &a("e1"), &none);
        assert!(ix.others(&a("e1"), "z").is_empty());
        assert_eq!(ix.urls(), 2);
        // The same engine again changes nothing.
        ix.set("c", &a("e2"), &a("e2"));
        assert_eq!(ix.others(&a("e2"), "z"), vec!["c".to_string()]);
        // A name resolving to two addresses is found by either; each id once.
        ix.set("d", &none, &["e2".to_string(), "e3".to_string()]);
        assert_eq!(
            ix.others(&["e2".to_string(), "e3".to_string()], "z"),
            vec!["b".to_string(), "c".into(), "d".into()]
        );
    }
}
